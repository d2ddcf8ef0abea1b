"""Give evicted slots' space back to the filesystem: ``fallocate(PUNCH_HOLE | KEEP_SIZE)`` over free slots.

Segments are preallocated (``posix_fallocate``) so that writing a page never needs new blocks; under a pool
quota a writer punches holes over the slot runs it freed, so other writers on the filesystem can use the
space. Invariants:
  * The file keeps its size (KEEP_SIZE): slot offsets never move; a punched range reads back as zeros, so a
    stale mapping of a punched slot fails its checksum (never served).
  * A later write into a punched slot allocates blocks again and can fail with ENOSPC (the device-full path
    handles it like any other write).
  * Only a slot that is free (released, and pinned by no reader) may be punched: the caller's job.
  * ``punch`` never raises: where holes are unsupported or refused it returns False and the space stays
    allocated. Slots are 4 KiB-aligned; partial filesystem blocks at either end are zeroed, not freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_Fallocate = Callable[[int, int, int, int], int]
_fallocate: _Fallocate | None = None
_loaded = False


def _load() -> _Fallocate | None:
    """libc's ``fallocate`` (64-bit offsets), or None off Linux or where libc has none."""
    global _fallocate, _loaded
    if _loaded:
        return _fallocate
    _loaded = True
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    _fallocate = fn
    return fn


def supported() -> bool:
    """Whether this platform has ``fallocate`` at all (a filesystem may still refuse holes)."""
    return _load() is not None


def punch(fd: int, offset: int, length: int) -> bool:
    """Deallocate ``length`` bytes at ``offset`` of open file ``fd``, keeping its size. True when done (or
    nothing to do); False where unsupported or failed (never raises, see the module docstring)."""
    if length == 0:
        return True
    if offset < 0 or length < 0:
        return False
    fn = _load()
    if fn is None:
        return False
    if fn(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    log.debug("punching %d bytes at %d of fd %d failed: %s", length, offset, fd, os.strerror(err))
    return False


def runs(slots: Iterable[int]) -> list[tuple[int, int]]:
    """Free slots as ``(first slot, count)`` runs of consecutive slots, ascending: one ``punch`` per run."""
    out: list[tuple[int, int]] = []
    for s in sorted(set(slots)):
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out
