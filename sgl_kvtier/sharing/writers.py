"""Writer identity: which ``w-<wid>`` directory of a namespace a writer process owns, and who is alive.

``wid = <host_id>-<k>``; ``host_id`` is the config's, or the hostname with every character outside
``[A-Za-z0-9._]`` replaced by ``_`` (so ``-`` only ever separates ``k``).

Claim (``claim_writer``): a starting writer takes the LOWEST ``k`` whose ``w-<host_id>-<k>/LOCK`` it can
``flock(LOCK_EX | LOCK_NB)`` (making the directory and file if needed) and holds it until its close. So a
restarted instance adopts a free directory, usually its own (warm); N writers starting at once never fail;
a directory carrying a fence (being retired) is skipped; a sole claim (``sharing = "off"``,
``sharing.sites.SoleSite``) tries ``k = 0`` only (held: ``StoreLockedError`` naming the holder's pid). A
reclaim (``sharing.quota_loop``) claims one exact wid the same way. Hosts never contend for a name: claims
touch only the host's own directories.

One mode per namespace (``refuse_mixed_modes``): a sole writer (no lease) and shared writers (leases, peers,
quota, retirement) never run at once in one namespace; the one claiming second is refused with
``SharingModeError`` naming ``sharing`` and the holder. The sole writer checks once its CONFIG is recorded,
a shared one right after its claim: of two starting at once at least one sees the other.

Duplicate ``host_id``: after a claim (not a reclaim), each ``w-<host_id>-<k>`` whose lease names another
``boot_id`` and was written within ``RECENT_BEATS`` heartbeats (its mtime) is watched for ``WATCH_BEATS``
heartbeats (each at most ``MAX_WATCHED_BEAT_S``); one whose mark changes is another machine beating there:
the claim is released and ``DuplicateHostError`` raised. ``ClaimWatch`` injects clock, sleep and reader.

Liveness (``writer_alive``, same host only): a ``LOCK`` nobody holds is dead at once (the probe's shared
``flock`` may make a writer starting in that instant take the next ``k``: a cold start, never an error); a
lease of this host from another ``boot_id`` is dead; a writer of another host is unknown (``None``).
A shared raw pool's regions are claimed by ``sharing.shared_raw_claim``; ``writer_dirs`` and
``writer_alive`` cover them too.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from sgl_kvtier.config import Sharing, StoreConfig
from sgl_kvtier.errors import ConfigError, DeviceError, KVTierError, StoreLockedError
from sgl_kvtier.media.shared_raw.regions import pool_writers, region_alive
from sgl_kvtier.sharing.lease import read_lease
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.devices import make_dir
from sgl_kvtier.store.format import WRITER_PREFIX, writer_dirname
from sgl_kvtier.store.layout import load_config
from sgl_kvtier.store.lifecycle import abandon, release_all
from sgl_kvtier.store.meta import LEASE

MAX_WRITERS_PER_HOST = 4096  # claim gives up past this many held directories (a runaway, not a real host)
RECENT_BEATS = 3  # a lease of another boot written longer ago than this many heartbeats is not watched
WATCH_BEATS = 2  # ... and a recent one is watched this many heartbeats for a change
MAX_WATCHED_BEAT_S = 5.0  # a longer heartbeat counts as this long here: no claim waits over 10 s
_NOT_HOST = re.compile(r"[^A-Za-z0-9._]")


def host_id(config: StoreConfig) -> str:
    """This host's name in writer ids: ``config.host_id``, or the hostname sanitised to ``[A-Za-z0-9._]``."""
    if config.host_id is not None:
        return config.host_id
    return _NOT_HOST.sub("_", socket.gethostname())[:64] or "host"


def writer_dirs(ns_meta: Path) -> list[tuple[str, Path]]:
    """``(wid, directory)`` of every writer directory of a namespace, sorted by wid; [] when none (or no
    namespace directory at all)."""
    try:
        entries = list(ns_meta.iterdir())
    except FileNotFoundError:
        return []
    except NotADirectoryError:  # a shared raw pool's namespace: every host slot's regions of it
        return [(wid, ns_meta / writer_dirname(wid)) for wid in pool_writers(ns_meta) or []]
    found = [(p.name[len(WRITER_PREFIX):], p) for p in entries
             if p.name.startswith(WRITER_PREFIX) and _is_dir(p)]
    return sorted(found)


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # ESTALE (Path.is_dir passes it on): another host removed it since the listing (NFS)
        return False


@dataclass
class WriterClaim:
    """A claimed writer directory: its wid, path and the ``LOCK`` descriptor held until ``release``."""

    wid: str
    host_id: str
    k: int
    path: Path
    lock_fd: int | None

    def release(self) -> None:
        """Give the lock up and close its descriptor (both attempted). Idempotent.

        The explicit unlock frees the lock even where a forked child still shares the descriptor (a flock
        belongs to the open file, not the process). Called last by a writer's close: crash rule, the next
        writer may adopt the directory only once every file of this one is closed."""
        fd, self.lock_fd = self.lock_fd, None  # detached first: released once, even if that fails
        if fd is not None:
            release_all([("unlock", partial(fcntl.flock, fd, fcntl.LOCK_UN)), ("close", partial(os.close, fd))])


class DuplicateHostError(StoreLockedError):
    """Another machine is beating a lease in a writer directory of this ``host_id``."""


class SharingModeError(ConfigError, StoreLockedError):
    """A live writer of the namespace runs under another ``sharing`` mode (one sole, the other shared)."""

    def __init__(self, problem: str):
        super().__init__("sharing", problem)


@dataclass(frozen=True)
class ClaimWatch:
    """How a claim watches leases of this ``host_id`` from another boot: ``clock`` is the wall clock (it is
    compared with LEASE mtimes), ``sleep`` waits between looks, ``read`` reads a LEASE file."""

    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    read: Callable[[Path], dict[str, Any] | None] = read_lease


def claim_writer(config: StoreConfig, ns_meta: Path, wid: str | None = None,
                 watch: ClaimWatch | None = None, *, sole: bool = False) -> WriterClaim:
    """Claim the lowest free ``w-<host_id>-<k>`` of the namespace (see the module docstring), or with
    ``wid`` that existing writer directory only (a reclaim of a dead writer of this host). ``watch``: the
    duplicate-host_id watch's clock, sleep and lease reader (default: the real ones). ``sole``: the
    namespace shard's one writer (``k = 0`` only).

    Raises DeviceError (the meta directory is not writable; ``wid``'s directory is not there or not of this
    host), DuplicateHostError (another machine beats in a directory of this host_id) or StoreLockedError
    (``sole`` and ``k = 0`` is held; ``wid`` is held; or, absurdly, every one of MAX_WRITERS_PER_HOST
    directories is held)."""
    host = host_id(config)
    if wid is not None:
        return _claim_exact(host, ns_meta, wid)
    claim = _claim_lowest(host, ns_meta, sole)
    try:
        _refuse_duplicate_host(config, host, ns_meta, watch or ClaimWatch())
    except BaseException as exc:
        abandon(exc, str(claim.path), [("writer lock", claim.release)])
        raise
    return claim


def _claim_lowest(host: str, ns_meta: Path, sole: bool) -> WriterClaim:
    try:
        make_dir(ns_meta)  # crash rule: durable in its parent before a writer directory is made in it
    except OSError as exc:
        raise DeviceError(f"{ns_meta.parent}: not writable ({exc.strerror})") from None
    last = 1 if sole else MAX_WRITERS_PER_HOST
    for k in range(last):
        wid = f"{host}-{k}"
        path = ns_meta / writer_dirname(wid)
        if _fenced(path):
            continue  # retired by a writer of another host and being deleted: never adopted (sharing = "cluster")
        fd = _lock_file(path)
        holder = try_lock(fd, path)
        if holder is None:
            return WriterClaim(wid, host, k, path, fd)
        if sole:
            raise StoreLockedError(f"{path}: already open for writing by pid {holder}; one writer process "
                                   "per namespace shard (sharing = \"off\")")
    raise StoreLockedError(f"{ns_meta}: all {last} writer directories of host {host} are held")


def refuse_mixed_modes(config: StoreConfig, ns_meta: Path, own_wid: str, sole: bool) -> None:
    """``SharingModeError`` when a writer of another mode holds a writer directory of the namespace now
    (module docstring). ``sole``: this writer is the shard's one (``sharing = "off"``), so any other writer
    holding its LOCK refuses it; else only one whose CONFIG records ``sharing = "off"`` does. A writer whose
    lease names another machine is not probed from here and is let be (one of this machine under another
    ``host_id`` is)."""
    here = host_id(config)
    for wid, path in writer_dirs(ns_meta):
        if wid == own_wid:
            continue
        theirs = recorded_sharing(path)
        if not sole and theirs is not Sharing.OFF:
            continue
        lease = read_lease(path / LEASE)
        probe_as = here
        if lease is not None and lease.get("machine_id") and lease.get("machine_id") == machine_id():
            probe_as = str(lease.get("host_id"))  # this machine under another host_id: probed all the same
        if writer_alive(path, lease, probe_as) is not True:
            continue  # dead, or another machine's (its lease names it): not probed from here
        pid, mode = lock_holder(path), "unknown" if theirs is None else theirs.value
        if sole:
            raise SharingModeError(f'{path} is open for writing by pid {pid} (sharing = "{mode}"), and a writer '
                                   'with sharing = "off" takes its namespace shard alone: stop that writer, or '
                                   'give every writer of the shard one sharing mode')
        raise SharingModeError(f'{path} is open for writing by pid {pid} with sharing = "off", which takes its '
                               f'namespace shard alone: stop it, or give every writer of the shard sharing = '
                               f'"{config.sharing.value}"')


def recorded_sharing(path: Path) -> Sharing | None:
    """The ``sharing`` mode writer directory ``path`` recorded in its CONFIG, or None (none readable)."""
    try:
        return load_config(path).sharing
    except (OSError, ValueError, TypeError, KeyError, KVTierError):
        return None


def lock_holder(path: Path) -> str:
    """The pid writer directory ``path``'s LOCK records (its holder's, if held), or "another process"."""
    try:
        fd = os.open(path / "LOCK", os.O_RDONLY)
    except OSError:
        return "another process"
    try:
        return _holder(fd)
    finally:
        os.close(fd)


def _mark(lease: dict[str, Any]) -> tuple[Any, Any]:
    return lease.get("counter"), lease.get("incarnation")


def _refuse_duplicate_host(config: StoreConfig, host: str, ns_meta: Path, watch: ClaimWatch) -> None:
    """DuplicateHostError when a recent lease of another boot in a directory of ``host`` changes while
    watched (module docstring); returns at once when there is no such lease."""
    mine = boot_id()
    if not mine:
        return
    now = watch.clock()
    watched: list[tuple[str, Path, tuple[Any, Any], str]] = []
    longest = 0.0
    for wid, path in writer_dirs(ns_meta):
        if wid.rpartition("-")[0] != host:
            continue
        lease = watch.read(path / LEASE)
        other = None if lease is None else lease.get("boot_id")
        if lease is None or not other or other == mine or lease.get("host_id") not in (None, host):
            continue
        beat_s = min(float(lease.get("heartbeat_s") or config.heartbeat_s), MAX_WATCHED_BEAT_S)
        try:
            age_s = now - (path / LEASE).stat().st_mtime
        except OSError:
            continue
        if age_s <= RECENT_BEATS * beat_s:  # a future mtime (a clock ahead of ours) is recent too
            watched.append((wid, path / LEASE, _mark(lease), str(other)))
            longest = max(longest, beat_s)
    if not watched:
        return
    deadline = now + WATCH_BEATS * longest
    while True:
        left = deadline - watch.clock()
        if left > 0:
            watch.sleep(min(left, longest / 4))
        for wid, lease_path, mark, other in watched:
            lease = watch.read(lease_path)
            if lease is not None and _mark(lease) != mark:
                raise DuplicateHostError(
                    f"two machines use host_id {host}: {writer_dirname(wid)} is beating from another boot "
                    f"(boot_id {other}, this one's is {mine}) in {ns_meta}: give each host its own host_id")
        if left <= 0:
            return


def _claim_exact(host: str, ns_meta: Path, wid: str) -> WriterClaim:
    owner, _, k = wid.rpartition("-")
    path = ns_meta / writer_dirname(wid)
    if owner != host or not k.isdigit() or not path.is_dir():
        raise DeviceError(f"{path}: no writer directory of host {host} to claim")
    try:
        fd = os.open(path / "LOCK", os.O_RDWR)
    except OSError as exc:
        raise DeviceError(f"{path}: cannot open its LOCK ({exc.strerror})") from None
    holder = try_lock(fd, path)
    if holder is not None:
        raise StoreLockedError(f"{path}: held by pid {holder}")
    return WriterClaim(wid, host, int(k), path, fd)


def try_lock(fd: int, where: Path) -> str | None:
    """Take the writer lock on ``fd`` (an open ``LOCK``: ``flock`` exclusive, non-blocking) and record
    this pid in it. None once taken; where another process holds it, that process's pid as recorded (or
    "another process"), with ``fd`` closed. A failure after the lock was taken releases it and ``fd``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        return holder
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except BaseException as exc:
        abandon(exc, str(where), [("writer lock", WriterClaim("", "", 0, where, fd).release)])
        raise
    return None


def _fenced(path: Path) -> bool:
    """Whether writer directory ``path`` carries a fence (``store.format``: FENCE); none when unreadable."""
    try:
        with open(path / "FENCE", "rb") as f:
            data = f.read(fmt.LEASE_BLOCK_BYTES)
    except OSError:
        return False
    return fmt.unpack_fence(data, str(path / "FENCE")) is not None


def _lock_file(path: Path) -> int:
    try:
        try:
            return _open_lock(path)
        except FileNotFoundError:
            # The directory went between making it and opening its LOCK: a retirer's last step (``sharing.retire``,
            # sharing = "cluster") removes an empty writer directory, this one just made. Once more.
            return _open_lock(path)
    except OSError as exc:
        raise DeviceError(f"{path.parent}: not writable ({exc.strerror})") from None


def _open_lock(path: Path) -> int:
    make_dir(path)  # crash rule: a second writer's directory survives a power cut with its files
    return os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
    except OSError:
        return "another process"


BOOT_ID_ENV = "KVTIER_BOOT_ID"  # tests only: processes of one kernel that stand for different machines


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``; the ``KVTIER_BOOT_ID`` environment variable
    instead where set: tests simulating other machines), or "" where there is none."""
    return os.environ.get(BOOT_ID_ENV) or _read_id("/proc/sys/kernel/random/boot_id")


def machine_id() -> str:
    """This machine's id (``/etc/machine-id``), or "" where it is not readable."""
    return _read_id("/etc/machine-id")


def _read_id(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def writer_alive(path: Path, lease: dict[str, object] | None, this_host: str) -> bool | None:
    """Whether the writer of directory ``path`` is alive: True / False on this host, None for a writer
    of another host (unknown here). ``lease``: its last lease (``lease.read_lease``), if any."""
    if lease is not None and lease.get("host_id") not in (None, this_host):
        return None
    if lease is not None and lease.get("boot_id") and boot_id() and lease.get("boot_id") != boot_id():
        return False  # its host (this one) rebooted since it last beat
    try:
        fd = os.open(path / "LOCK", os.O_RDONLY)
    except FileNotFoundError:
        return False
    except NotADirectoryError:  # a region of a shared raw pool: its OFD writer lock (``media.shared_raw.superblock``)
        return region_alive(path)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock, if it was taken
    return False
