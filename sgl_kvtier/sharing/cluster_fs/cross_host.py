"""What one host sees of another host's file operations (``sgl-kvtier check-shared --peer-wait`` on two hosts).

``exchange(directory, seconds)`` runs on two hosts at once. Each leaves a probe (``probes.PEER_PREFIX``,
its identity and its state) and three files of its own: a lock file it holds ``flock(LOCK_EX)`` on, a data
file of one 4 KiB block, and a name it will rename a new file over. Each host is the *owner* of its files and
the *observer* of the other's:
  1. observer: opens the other's data file (O_DIRECT where allowed) and reads the old block through that
     descriptor, reads the name's old content, and tries ``flock(LOCK_EX | LOCK_NB)`` on the lock file:
     refused means locks are cluster-wide, granted host-local. Then says ``opened``.
  2. owner, once the other says ``opened``: overwrites its block in place (fsynced) and renames a new file
     over its name; then says ``overwritten``.
  3. observer, once the other says ``overwritten``: reads through the descriptor opened in step 1 (the new
     block, or the old one: a stale descriptor, then watched up to ``CATCH_UP_S`` for catching up), through a
     fresh open (the new block, else the hosts do not see each other's writes), and opens the name until it
     holds the new file (``ENOENT`` meanwhile: a rename over a name briefly invisible). Then says ``result``.
It ends once both hosts have their result, or at ``seconds``; every file it made is removed, its lock
released. JuiceFS, for one, shows cluster-wide locks, stale descriptors and a rename briefly invisible.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_kvtier.io.buffers import ALIGN, AlignedBuffer
from sgl_kvtier.store.devices import write_file_atomic

PEER_PREFIX = ".kvtier-peer-"  # check-shared --peer-wait: one probe file per running check
PEER_POLL_S = 0.2  # how often a peer wait looks at the directory
CATCH_UP_S = 3.0  # how long a stale descriptor, a fresh open or a renamed name is watched for the new bytes
GONE_S = 2.0  # the other's probe unreadable this long, once this host has its result: the other finished
OLD, NEW = b"old", b"new"


def read_probe(path: Path) -> dict[str, Any] | None:
    """The probe in ``path``, or None (gone, not readable now, not a probe)."""
    try:
        probe = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return probe if isinstance(probe, dict) else None


def find_peer(directory: Path, mine: Path, me: dict[str, Any], since: float) -> tuple[Path, dict[str, Any]] | None:
    """The first probe in ``directory`` other than ``mine``, made since ``since`` (wall clock), of another
    host than ``me`` (another boot_id or machine_id): its path and content; None where there is none."""
    for path in sorted(directory.glob(PEER_PREFIX + "*.json")):
        if path == mine:
            continue
        try:
            if path.stat().st_mtime < since:
                continue  # left by a check that ran long before this one
        except OSError:
            continue
        other = read_probe(path)
        if other is not None and (other.get("boot_id"), other.get("machine_id")) != (me["boot_id"], me["machine_id"]):
            return path, {k: v for k, v in other.items() if k != "seen"}
    return None


class LockScope(str, enum.Enum):
    """Whether a ``flock`` held on one host blocks another host."""

    HOST_LOCAL = "host-local"
    CLUSTER_WIDE = "cluster-wide"


@dataclass(frozen=True)
class CrossHost:
    """What this host saw of the other host's files (module docstring). ``descriptor_stale_s``: None where a
    descriptor opened before the other host's overwrite read the new bytes at once, else how long it kept the
    old ones (``CATCH_UP_S`` or more: it never caught up while watched). ``fresh_open_sees``: a fresh open
    read the new bytes. ``rename_missing``: the name was ENOENT after the rename; ``rename_visible_s``: when
    the new file showed (None: not within ``CATCH_UP_S``)."""

    lock_scope: LockScope
    descriptor_stale_s: float | None
    fresh_open_sees: bool
    rename_missing: bool
    rename_visible_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"lock_scope": self.lock_scope.value, "descriptor_stale_s": self.descriptor_stale_s,
                "fresh_open_sees": self.fresh_open_sees, "rename_missing": self.rename_missing,
                "rename_visible_s": self.rename_visible_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CrossHost:
        return cls(LockScope(d["lock_scope"]), d["descriptor_stale_s"], bool(d["fresh_open_sees"]),
                   bool(d["rename_missing"]), d["rename_visible_s"])


def block(name: str, which: bytes) -> bytes:
    """The 4 KiB block the data file ``name`` holds before (``OLD``) or after (``NEW``) the overwrite."""
    return hashlib.sha256(name.encode() + which).digest() * (ALIGN // 32)


class _Files:
    """This host's side of an exchange: its probe and the three files it owns (module docstring)."""

    def __init__(self, directory: Path, identity: dict[str, Any]):
        tag = uuid.uuid4().hex
        self.probe = directory / f"{PEER_PREFIX}{tag}.json"
        self.lock, self.data, self.name = (directory / f".kvtier-x{kind}-{tag}" for kind in ("lock", "data", "name"))
        self.state: dict[str, Any] = {**identity, "seen": [], "files": {
            "lock": self.lock.name, "data": self.data.name, "name": self.name.name}}
        self._lock_fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        _write_block(self.data, block(self.data.name, OLD), create=True)
        write_file_atomic(self.name, OLD)
        self.publish()

    def publish(self, **changes: Any) -> None:
        """Write the probe: made by a rename (it appears whole), then rewritten in place, which a fresh open on
        the other host sees at once (a rename over it may stay invisible there for a while, and so delay
        the steps it signals past what they measure). A read of it half-written is no probe: read again."""
        self.state.update(changes)
        data = json.dumps(self.state).encode()
        if not changes:
            write_file_atomic(self.probe, data)
            return
        fd = os.open(self.probe, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def overwrite(self) -> None:
        _write_block(self.data, block(self.data.name, NEW), create=False)
        write_file_atomic(self.name, NEW)
        self.publish(overwritten=True)

    def close(self) -> None:
        os.close(self._lock_fd)
        for path in (self.probe, self.lock, self.data, self.name, self.name.with_name(self.name.name + ".tmp")):
            path.unlink(missing_ok=True)


def _open_direct(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags, 0o600)  # no O_DIRECT here: the plain descriptor is what is probed


def _write_block(path: Path, data: bytes, create: bool) -> None:
    fd = _open_direct(path, os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0))
    buf = AlignedBuffer(ALIGN)
    try:
        buf.view[:] = data
        os.pwritev(fd, [buf.view], 0)
        os.fsync(fd)
    finally:
        buf.close()
        os.close(fd)


def _read_block(fd: int) -> bytes:
    buf = AlignedBuffer(ALIGN)
    try:
        n = os.preadv(fd, [buf.view], 0)
        return bytes(buf.view[:n])
    finally:
        buf.close()


def _read_fresh(path: Path) -> bytes | None:
    try:
        fd = _open_direct(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return _read_block(fd)
    finally:
        os.close(fd)


def _lock_scope(path: Path) -> LockScope:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return LockScope.CLUSTER_WIDE
    finally:
        os.close(fd)  # (releases the lock where it was granted)
    return LockScope.HOST_LOCAL


class _Observer:
    """This host watching the other host's files (steps 1 and 3 of the module docstring)."""

    def __init__(self, directory: Path, files: dict[str, str], clock: Callable[[], float],
                 sleep: Callable[[float], None]):
        self.data, self.lock, self.name = (directory / files[k] for k in ("data", "lock", "name"))
        self.clock, self.sleep = clock, sleep
        self.fd = -1
        self.scope: LockScope | None = None

    def open(self) -> bool:
        """Step 1; False while the other's files are not all visible yet (tried again at the next poll)."""
        try:
            fd = _open_direct(self.data, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            if _read_block(fd) != block(self.data.name, OLD) or _read_fresh(self.name) is None:
                raise FileNotFoundError
            self.scope = _lock_scope(self.lock)
        except FileNotFoundError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def _watch(self, got: Callable[[], bool]) -> float | None:
        """Seconds until ``got()`` (0.0: at the first look), or None where it stayed false for ``CATCH_UP_S``."""
        start, first = self.clock(), True
        while True:
            if got():
                return 0.0 if first else self.clock() - start
            first = False
            if self.clock() - start >= CATCH_UP_S:
                return None
            self.sleep(PEER_POLL_S)

    def look(self) -> None:
        """Look the name up again (while waiting for step 2): its cached entry is as fresh as a reader's."""
        try:
            self.name.read_bytes()
        except OSError:
            pass

    def result(self) -> CrossHost:
        """Step 3: the rename first (its window is the shortest), then the held descriptor, then a fresh open."""
        missing = False

        def renamed() -> bool:
            nonlocal missing
            try:
                return self.name.read_bytes() == NEW
            except FileNotFoundError:
                missing = True
                return False

        shown = self._watch(renamed)
        new = block(self.data.name, NEW)
        caught = self._watch(lambda: _read_block(self.fd) == new)
        stale = None if caught == 0.0 else (CATCH_UP_S if caught is None else caught)
        fresh = self._watch(lambda: _read_fresh(self.data) == new) is not None
        assert self.scope is not None
        return CrossHost(self.scope, stale, fresh, missing, shown)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def exchange(directory: Path, seconds: float, identity: dict[str, Any], *, sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> tuple[dict[str, Any] | None, CrossHost | None]:
    """Run the exchange in ``directory`` with another host running it at once, for at most ``seconds``
    (``identity``: this host's ``host``, ``boot_id``, ``machine_id`` and ``pid``, as its probe shows them): the
    other host's identity (None: none seen) and what this host saw of its files (None: the exchange did not
    get that far). Raises OSError where this host's own files cannot be made."""
    me = _Files(directory, identity)
    since = time.time() - seconds - 5.0
    deadline = clock() + seconds
    peer: tuple[Path, dict[str, Any]] | None = None
    observer: _Observer | None = None
    seen: CrossHost | None = None
    unread_since: float | None = None  # when the other's probe last became unreadable
    try:
        while True:
            if peer is None:
                peer = find_peer(directory, me.probe, me.state, since)
                if peer is not None:
                    me.publish(seen=[peer[0].name])
            theirs = None if peer is None else read_probe(peer[0])  # None: gone, or mid-rename (next poll)
            if theirs is None and peer is not None:
                unread_since = clock() if unread_since is None else unread_since
                if seen is not None and clock() - unread_since >= GONE_S:
                    break  # it had its result (it leaves only then) and removed its files
            else:
                unread_since = None
            if theirs is not None and isinstance(theirs.get("files"), dict):
                if observer is None:
                    observer = _Observer(directory, theirs["files"], clock, sleep)
                if not me.state.get("opened") and observer.open():
                    me.publish(opened=True)
                if theirs.get("opened") and not me.state.get("overwritten"):
                    me.overwrite()
                if theirs.get("overwritten") and seen is None and observer.fd >= 0:
                    seen = observer.result()
                    me.publish(result=seen.to_dict())
                elif seen is None and observer.fd >= 0:
                    observer.look()
                if seen is not None and theirs.get("result") is not None:
                    break
            if clock() >= deadline:
                break
            sleep(PEER_POLL_S)
    finally:
        if observer is not None:
            observer.close()
        me.close()
    other = None if peer is None else {k: v for k, v in peer[1].items() if k in ("host", "boot_id", "machine_id", "pid")}
    return other, seen
