"""Retiring a dead writer of another host (``sharing = "cluster"``): fence it, then delete all of its files
(the protocol argument is in docs/design/sharing.md; ``sharing.quota_loop`` decides when).

  1. ``write_fence``: the FENCE block (``store.format``) naming the incarnation of the writer's last lease,
     ``pwrite`` + ``fsync``; nothing is fenced where the LEASE names another incarnation (made anew).
  2. ``delete_writer``: its segments on every directory device, then its journals and checkpoint, then every
     other file, then LEASE, then LOCK; that pass again while the last one found files (a writer only
     paused writes on until its next beat reads its fence), at most ``SWEEPS``; then the directories synced,
     FENCE last; then the directories removed. The crash-ordering choice of each step is at its code.
Every step is idempotent and tolerates a concurrent deleter, so a retirer dying half-way leaves a directory
every observer still judges ``RETIRED`` (its fence is the last file to go), and any live writer continues
the deletion. A pass finding no fence on the directory's lease only removes the directories once empty:
the deletion is at its end, or a writer made the directory anew under the same wid (its files are not
ours); a crash between FENCE's unlink and the ``rmdir`` leaves an empty directory (nobody's, costs
nothing). A writer retired while only paused finds the fence at its next beat and re-registers elsewhere
(``sharing.fencing``); what it wrote in between is lost, a miss, never wrong bytes. A shared raw pool
retires nobody.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.sharing.lease import read_lease
from sgl_kvtier.sharing.liveness import FENCE, fence_retires, read_fence
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.devices import fsync_dir
from sgl_kvtier.store.format import writer_dirname
from sgl_kvtier.store.meta import LEASE

log = logging.getLogger(__name__)
LOCK = "LOCK"
_GONE = (errno.ENOENT, errno.ESTALE)  # ESTALE: another host removed it under this one's NFS handle
_DIR_KEPT = (*_GONE, errno.ENOTEMPTY, errno.EEXIST)  # rmdir: gone, or a file appeared (left for later)
SWEEPS = 4  # passes over a retired writer's files at most: one, and again while the last one found files


@dataclass
class Deleted:
    """What one ``delete_writer`` pass removed: files, and the bytes the segments among them held."""

    files: int = 0
    segment_bytes: int = 0
    finished: bool = False  # the writer directory itself is gone
    passes: int = 0  # passes over its files (``delete_writer``: again while one finds files, at most SWEEPS)


def write_fence(directory: Path, incarnation: bytes, by: str, by_host: str) -> bool:
    """Fence the writer of ``directory``: its ``FENCE`` names ``incarnation`` (retired by writer ``by`` of
    host ``by_host``). True once fenced; False when there is nothing left to fence: the directory is gone (before
    this fence was written, or after: another retirer deleted it, fence and all, in between), its deletion
    is past its LEASE (another retirer is at its last steps), or its LEASE names another incarnation (a
    writer re-registered under the wid, or restarted into it). Raises OSError otherwise (nothing
    is deleted then: the caller tries again on a later step)."""
    lease = read_lease(directory / LEASE)
    if lease is not None and lease.get("incarnation") != incarnation:
        return False  # another incarnation beats here now (re-registered under this wid, or restarted): not ours
    block = fmt.pack_fence_block({"incarnation": incarnation, "by": by, "by_host": by_host, "at": time.time()})
    path = directory / FENCE
    fd = _open_fence(path)
    if fd is None:
        return False
    try:
        # Crash rule: the fence is durable before any file of the writer is deleted, so a directory with
        # files missing always carries it (and stays RETIRED for every observer until FENCE itself goes).
        os.pwrite(fd, block, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        fsync_dir(directory)  # a FENCE created here (its owner made none) survives a power cut
    except OSError as exc:
        if exc.errno not in _GONE:
            raise
        return False  # another retirer deleted everything, this FENCE included, and the directory meanwhile
    return True


def _open_fence(path: Path) -> int | None:
    """``path`` (a FENCE) opened for writing, never truncated (its owner holds this very file open); None
    when it is not to be written. A deletion unlinks LEASE before FENCE (``delete_writer``): so no FENCE
    beside no LEASE means another retirer is at its last steps, and creating FENCE again would leave a file
    in a directory that retirer is about to remove. Only a directory with a LEASE and no FENCE (its owner
    made none) gets one created."""
    try:
        return os.open(path, os.O_WRONLY)
    except OSError as exc:
        if exc.errno not in _GONE:
            raise
    if not (path.parent / LEASE).exists():
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    except OSError as exc:
        if exc.errno not in _GONE:
            raise
        return None  # the directory went meanwhile


def writer_directories(config: StoreConfig, ns_meta: Path, wid: str) -> list[Path]:
    """Every directory of writer ``wid`` of the namespace at ``ns_meta``: one per directory device
    (segments), then its meta directory (last: it holds the FENCE)."""
    meta = ns_meta / writer_dirname(wid)
    devs = [Path(d) / ns_meta.name / writer_dirname(wid) for d in config.devices if os.path.isdir(d)]
    return [d for d in dict.fromkeys(devs) if d != meta] + [meta]


def delete_writer(config: StoreConfig, ns_meta: Path, wid: str) -> Deleted:
    """Delete every file of retired writer ``wid`` (fenced already: ``write_fence``), then its directories,
    in the order of the module docstring. Idempotent; tolerates a concurrent deleter. Raises OSError on a
    failure other than "already gone" (what was deleted stays deleted; a later pass continues)."""
    done = Deleted()
    dirs = writer_directories(config, ns_meta, wid)
    meta = dirs[-1]
    if not _fenced(meta):
        # No fence on the lease there: only the directories are left to go (another deleter is at its last
        # step), or the directory was made anew since it was judged (its writer re-registered under the same
        # wid, or restarted into it: a live writer's FENCE is empty): its files are not ours, nor its
        # directories while it has any file.
        return done if _listed(meta, "*") else _remove_dirs(dirs, ns_meta, done)
    swept = -1
    while swept != done.files and done.passes < SWEEPS:
        # Again while a pass found files: the writer, if only paused, writes on until its next beat reads its
        # fence (a checkpoint, a new journal or segment): what it made after a listing goes in the next pass,
        # while the fence is still there (a FENCE gone marks the end: nothing made after it is swept).
        swept = done.files
        _delete_files(dirs, meta, done)
    if swept != done.files:
        return done  # its last pass still found files: the fence stays, a later step continues (it sees it soon)
    # Crash rule: every deletion above is durable before FENCE goes, so a power cut can never bring a
    # file of the writer back into a directory that no longer carries its fence.
    for d in dirs:
        _sync_dir(d)
    _unlink(meta / FENCE, done)
    return _remove_dirs(dirs, ns_meta, done)


def _delete_files(dirs: list[Path], meta: Path, done: Deleted) -> None:
    """One pass over the writer's files but its FENCE, in the order of the module docstring."""
    done.passes += 1
    # Crash rule: segments first, on every device: they hold the bytes the pool wants back. A reader still
    # holding the journals maps keys into segments that are gone: a miss (ENOENT, a short read), never a page.
    for d in dirs:
        for seg in _listed(d, "seg-*.dat"):
            done.segment_bytes += _unlink(seg, done, size=True)
    # Crash rule: the index (journals, then the checkpoint) after the data it points into, never before:
    # until here a reader opening the directory finds an index, afterwards nothing at all.
    for pattern in ("journal-*.log", "checkpoint.bin"):
        for path in _listed(meta, pattern):
            _unlink(path, done)
    keep_last = (LEASE, LOCK, FENCE)
    for path in _listed(meta, "*"):  # CONFIG, tmp leftovers of checkpoints and configs, anything newer
        if path.name not in keep_last and not path.is_dir():
            _unlink(path, done)
    # Crash rule: LEASE, then LOCK: with the lease gone the fence alone still marks the directory RETIRED.
    for name in (LEASE, LOCK):
        _unlink(meta / name, done)


def _fenced(meta: Path) -> bool:
    """Whether the writer of directory ``meta`` is retired (``liveness`` rule 1): its FENCE names the
    incarnation of its lease, or its lease is gone already (a deletion under way)."""
    fence = read_fence(meta)
    return fence is not None and fence_retires(fence, read_lease(meta / LEASE))  # the lease read only behind a fence


def _remove_dirs(dirs: list[Path], ns_meta: Path, done: Deleted) -> Deleted:
    for d in dirs:
        _rmdir(d)  # a directory a new writer has files in again is left to it (ENOTEMPTY)
    done.finished = not dirs[-1].exists()
    if done.finished:
        _sync_dir(ns_meta)
    return done


def retire(config: StoreConfig, ns_meta: Path, wid: str, incarnation: bytes, by: str, by_host: str) -> Deleted:
    """Fence dead writer ``wid`` (its last lease's ``incarnation``), then delete its files; what was deleted
    (by this call: with another retirer ahead of it, only directories it found empty). Raises OSError (see
    ``write_fence`` / ``delete_writer``)."""
    fenced = write_fence(ns_meta / writer_dirname(wid), incarnation, by, by_host)
    done = delete_writer(config, ns_meta, wid)  # unfenced: another retirer is ahead, at most directories remain
    if not fenced:
        return done
    log.info("retired dead writer %s of %s (fenced by %s): %d files, %d segment bytes", wid, ns_meta, by,
             done.files, done.segment_bytes)
    return done


def _listed(directory: Path, pattern: str) -> list[Path]:
    try:
        return sorted(directory.glob(pattern))
    except OSError as exc:
        if exc.errno in _GONE:
            return []
        raise


def _unlink(path: Path, done: Deleted, size: bool = False) -> int:
    """Remove ``path`` (already gone is fine); its allocated bytes when ``size``."""
    held = 0
    try:
        if size:
            held = os.stat(path).st_blocks * 512
        os.unlink(path)
        done.files += 1
    except OSError as exc:
        if exc.errno not in _GONE:
            raise
        return 0
    return held


def _rmdir(path: Path) -> None:
    try:
        os.rmdir(path)
    except OSError as exc:
        if exc.errno not in _DIR_KEPT:
            raise


def _sync_dir(path: Path) -> None:
    try:
        fsync_dir(path)
    except OSError as exc:
        if exc.errno not in _GONE:
            raise
