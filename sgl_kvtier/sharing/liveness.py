"""Who is alive: one verdict per writer directory of a namespace, for the pool, the quota and ``inspect``
(the protocol argument is in docs/design/sharing.md).

A ``LeaseWatch`` belongs to one observer and remembers when each writer's lease mark ``(counter,
incarnation)`` last changed ON THE OBSERVER'S OWN MONOTONIC CLOCK; no other host's clock, file mtime or
lease time is ever used for a verdict. Verdicts, first rule that applies:
  1. ``RETIRED`` (``sharing = "cluster"`` only): its ``FENCE`` names the incarnation of its last lease (or
     there is no lease): a live writer of another host retired it (``sharing.retire``). Never read again.
  2. Same host and boot (or no lease yet): the ``LOCK`` flock (``writers.writer_alive``): held ``LIVE``,
     free ``DEAD``.
  3. This host's ``host_id`` from another boot: ``DEAD``, unless its mark changes under our watch (``LIVE``:
     another machine uses our ``host_id``).
  4. Another host: ``LIVE`` until its mark stayed unchanged for ``dead_after_s`` of our watching, then
     ``DEAD``; a mark that changes again is ``LIVE`` again. ``reclaim_due``: unchanged for ``reclaim_after_s``.
  No readable lease and no LOCK: ``UNKNOWN``.
``FENCE`` is read with O_DIRECT where allowed (an existing file, so no network-filesystem cache hides a
fence). ``judge`` reads it every time; ``retired`` (a pool's refresh) only when the writer is new, its lease
mark moved, or the last read is ``heartbeat_s`` old. ``OwnFence`` is the owner's side: its FENCE created
empty at open and held open, read at every beat; a FENCE (or the LOCK it holds) found deleted counts as a
fence too (only a retirer deletes them, after fencing).
"""

from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from sgl_kvtier.config import Sharing, StoreConfig
from sgl_kvtier.sharing.writers import boot_id, host_id, writer_alive
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.lifecycle import release_all

log = logging.getLogger(__name__)
FENCE = "FENCE"


class Verdict(str, enum.Enum):
    """What an observer concludes about one writer."""

    LIVE = "live"
    DEAD = "dead"
    RETIRED = "retired"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Judged:
    """One verdict with its grounds: ``same_host`` (judged by flock), ``unchanged_s`` (how long this observer
    has seen the lease mark unchanged; 0 at first sight), ``reason`` (a few words for logs and inspect)."""

    verdict: Verdict
    same_host: bool
    unchanged_s: float
    reason: str


def read_fence(directory: Path) -> dict[str, Any] | None:
    """The fence in writer directory ``directory`` (``FENCE``), or None when there is none (no file, empty,
    torn, unreadable)."""
    path = directory / FENCE
    data = _read_direct(path, fmt.LEASE_BLOCK_BYTES)
    return None if data is None else fmt.unpack_fence(data, str(path))


def fence_retires(fence: dict[str, Any] | None, lease: dict[str, Any] | None) -> bool:
    """Rule 1 on a directory's fence and lease as read: the fence names the incarnation of the lease, or
    there is no lease (its deletion is under way). An empty FENCE (a live writer's own) reads as None."""
    return fence is not None and (lease is None or fence.get("incarnation") == lease.get("incarnation"))


def _read_direct(path: Path, size: int) -> bytes | None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    for attempt_flags in (flags, os.O_RDONLY) if flags != os.O_RDONLY else (os.O_RDONLY,):
        try:
            fd = os.open(path, attempt_flags)
        except OSError:
            if attempt_flags == os.O_RDONLY:
                return None
            continue
        try:
            return _pread_aligned(fd, size)
        except OSError:
            if attempt_flags == os.O_RDONLY:
                return None
        finally:
            os.close(fd)
    return None


def _pread_aligned(fd: int, size: int) -> bytes:
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT wants
    try:
        got = os.preadv(fd, [buf], 0)
        return bytes(buf[:got])
    finally:
        buf.close()


class LeaseWatch:
    """One observer's watch over the writers of its pools (see the module docstring). Thread-safe."""

    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.host = host_id(config)
        # directory -> (lease mark, when it last changed on our clock, whether we ever saw it change)
        self._seen: dict[str, tuple[Any, float, bool]] = {}
        # directory -> (lease mark it was read under, when on our clock (taken before the read), the fence)
        self._fences: dict[str, tuple[Any, float, dict[str, Any] | None]] = {}
        self._lock = threading.Lock()

    def watch(self, directory: Path, lease: dict[str, Any] | None) -> tuple[float, bool]:
        """Record ``lease``'s mark; how long this observer has seen it unchanged (0: first sight, or it just
        changed) and whether it has ever changed under this watch."""
        mark = _mark(lease)
        now = self.clock()
        with self._lock:
            seen = self._seen.get(str(directory))
            if seen is None or (seen[0] != mark and not _older(mark, seen[0])):
                self._seen[str(directory)] = (mark, now, seen is not None)
                return 0.0, seen is not None
            # The same mark, or an older read of the same incarnation (a lease read before the last one
            # recorded, e.g. the pool's last refresh after the quota's fresh read): no change.
            return max(0.0, now - seen[1]), seen[2]

    def judge(self, directory: Path, lease: dict[str, Any] | None) -> Judged:
        """The verdict on the writer of ``directory`` whose last lease read is ``lease`` (None: none)."""
        unchanged, changed = self.watch(directory, lease)
        retired = self.retired(directory, lease, fresh=True)
        if retired is not None:
            return Judged(Verdict.RETIRED, False, unchanged, retired)
        here = lease is None or lease.get("host_id") == self.host
        this_boot = lease is None or not lease.get("boot_id") or not boot_id() or lease.get("boot_id") == boot_id()
        if here and this_boot:
            alive = writer_alive(directory, lease, self.host)
            if alive is None:
                return Judged(Verdict.UNKNOWN, True, unchanged, "no lease, LOCK unreadable")
            return Judged(Verdict.LIVE if alive else Verdict.DEAD, True, unchanged,
                          "LOCK held" if alive else "LOCK free")
        advancing = changed and unchanged < self.config.dead_after_s
        if here:  # our host_id, another boot
            if advancing:
                return Judged(Verdict.LIVE, False, unchanged,
                              "a lease of another boot is advancing: another machine uses this host_id")
            return Judged(Verdict.DEAD, True, unchanged, "this host rebooted since its last beat")
        if unchanged >= self.config.dead_after_s:
            return Judged(Verdict.DEAD, False, unchanged, f"lease unchanged for {unchanged:.0f} s")
        return Judged(Verdict.LIVE, False, unchanged, "lease advancing" if advancing else
                      f"lease unchanged for {unchanged:.1f} s (dead after {self.config.dead_after_s:g} s)")

    def forget(self, directory: Path) -> None:
        """Stop remembering ``directory`` (it was removed)."""
        with self._lock:
            self._seen.pop(str(directory), None)
            self._fences.pop(str(directory), None)

    def retired(self, directory: Path, lease: dict[str, Any] | None, fresh: bool = False) -> str | None:
        """Rule 1 alone: why the writer of ``directory`` is ``RETIRED``, or None. Its FENCE only (no LOCK
        probe, no lease mark recorded): what a reader needs on every refresh. Read from the file only when
        ``fresh``, the writer is new to this watch, its lease mark moved, or the last read is ``heartbeat_s``
        old (see the module docstring); else the last read's fence is judged against ``lease``."""
        if self.config.sharing is not Sharing.CLUSTER:
            return None
        fence = self._fence(directory, _mark(lease), fresh)
        if fence is not None and fence_retires(fence, lease):
            return f"retired by {fence.get('by')}"
        return None

    def _fence(self, directory: Path, mark: Any, fresh: bool) -> dict[str, Any] | None:
        key, now = str(directory), self.clock()
        with self._lock:
            last = self._fences.get(key)
        if not fresh and last is not None and last[0] == mark and now - last[1] < self.config.heartbeat_s:
            return last[2]
        fence = read_fence(directory)  # outside the lock: an open and a read on a shared filesystem
        with self._lock:
            kept = self._fences.get(key)
            # Ordering: the time is taken before the read, and a read never replaces one that began later,
            # so a fence written after a remembered read is read again within heartbeat_s of that write.
            if kept is None or kept[1] <= now:
                self._fences[key] = (mark, now, fence)
        return fence

    def reclaim_due(self, judged: Judged) -> bool:
        """Whether a verdict is a writer of another host dead for ``reclaim_after_s`` (see the module docstring)."""
        return (judged.verdict is Verdict.DEAD and not judged.same_host
                and judged.unchanged_s >= self.config.reclaim_after_s)


class OwnFence:
    """A writer's own ``FENCE`` (see the module docstring): created empty if absent and held open from
    construction; ``check`` reads it through that descriptor. Thread-safe."""

    def __init__(self, directory: Path, incarnation: bytes, lock_fd: int | None = None):
        """``lock_fd``: the writer's ``LOCK`` descriptor, watched too (a copy is held: the claim's own may
        close first). Raises OSError where the file can be neither opened nor created."""
        self.path = directory / FENCE
        self.lock_path = directory / "LOCK"
        self.incarnation = incarnation
        self._lock = threading.Lock()
        self._lock_fd = -1 if lock_fd is None else os.dup(lock_fd)
        direct = getattr(os, "O_DIRECT", 0)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | direct, 0o600)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o600)  # no O_DIRECT here (tmpfs)

    def check(self, any_incarnation: bool = False) -> str | None:
        """Why this writer is fenced (a few words), or None while it is not. ``any_incarnation``: a fence
        naming any incarnation counts (a directory found fenced at open was retired: never reused). A read
        failing otherwise is None: the next beat reads again."""
        with self._lock:
            if self._fd < 0:
                return None
            try:
                # A retirement that ran between this writer's claim and its first fence check deleted the
                # directory's files (its LOCK too) and then its FENCE, before this one was made: only the LOCK
                # it holds shows it. Left unnoticed, another process could claim the same directory.
                if self._lock_fd >= 0 and _unlinked(self._lock_fd, self.lock_path):
                    return "its LOCK was deleted (retired)"
                if os.fstat(self._fd).st_nlink == 0:
                    return "its FENCE was deleted (retired)"
                data = _pread_aligned(self._fd, fmt.LEASE_BLOCK_BYTES)
            except OSError as exc:
                if exc.errno in (errno.ESTALE, errno.ENOENT):
                    return f"its FENCE or LOCK is gone ({errno.errorcode.get(exc.errno, exc.errno)})"
                log.debug("%s: fence unreadable this beat: %r", self.path, exc)
                return None
        fence = fmt.unpack_fence(data, str(self.path))
        if fence is None or not (any_incarnation or fence.get("incarnation") == self.incarnation):
            return None
        return f"retired by {fence.get('by')} of host {fence.get('by_host')}"

    def close(self) -> None:
        """Close the descriptor. Idempotent."""
        with self._lock:
            fds, self._fd, self._lock_fd = (self._fd, self._lock_fd), -1, -1
        release_all([(f"close {fd}", partial(os.close, fd)) for fd in fds if fd >= 0])


def _mark(lease: dict[str, Any] | None) -> Any:
    """A lease's mark ``(counter, incarnation)``: what changes at each beat and each open; None without one."""
    return None if lease is None else (lease.get("counter"), lease.get("incarnation"))


def _older(mark: Any, seen: Any) -> bool:
    """Whether lease mark ``mark`` (counter, incarnation) is an earlier beat of the incarnation of ``seen``."""
    if mark is None or seen is None or mark[1] != seen[1]:
        return False
    try:
        return int(mark[0]) <= int(seen[0])
    except (TypeError, ValueError):
        return False


def _unlinked(fd: int, path: Path) -> bool:
    """Whether the file open as ``fd`` is no longer the one at ``path`` (unlinked, replaced or gone). An error
    reading the descriptor propagates (ESTALE: another host removed it)."""
    held = os.fstat(fd)
    if held.st_nlink == 0:
        return True
    try:
        now = os.stat(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ESTALE):
            return True
        raise
    return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)
