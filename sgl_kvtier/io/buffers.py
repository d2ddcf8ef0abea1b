"""Caller memory as buffers, and aligned scratch memory for O_DIRECT.

Callers (SGLang's host pool) hand pages over as *runs*: ``(address, length)`` pairs into memory they own
and keep alive for the duration of the call. ``view`` wraps a run as a writable memoryview without copying.

O_DIRECT needs every buffer address and length, and the file offset, aligned to the device's logical
block size; we use ``ALIGN`` = 4096, which covers every device. A page whose runs are not all aligned is
moved through a ``BouncePool`` buffer (one memcpy) instead of being refused.
"""

from __future__ import annotations

import ctypes
import mmap
import queue
import threading
from collections.abc import Sequence

ALIGN = 4096

Run = tuple[int, int]  # (address, length in bytes)


def view(address: int, length: int) -> memoryview:
    """A writable, zero-copy view of ``length`` bytes at ``address`` (which the caller keeps alive)."""
    return memoryview((ctypes.c_ubyte * int(length)).from_address(int(address))).cast("B")


def runs_aligned(runs: Sequence[Run], align: int = ALIGN) -> bool:
    return all(addr % align == 0 and length % align == 0 for addr, length in runs)


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class AlignedBuffer:
    """Page-aligned anonymous memory, prefaulted once and reused (fresh memory is slow to touch)."""

    def __init__(self, nbytes: int):
        self.nbytes = round_up(max(nbytes, ALIGN))
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._map)
        self.view[:] = b"\0" * self.nbytes  # prefault
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def close(self) -> None:
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a view still exported by a caller; the mapping dies with the process
            pass


class BouncePool:
    """A fixed set of aligned buffers of one size, handed out to IO workers; blocks when all are in use."""

    def __init__(self, nbytes: int, count: int):
        self.nbytes = round_up(nbytes)
        self.count = count
        self._free: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
        self._all: list[AlignedBuffer] = []
        self._created = 0
        self._lock = threading.Lock()

    def acquire(self) -> AlignedBuffer:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            create = self._created < self.count
            self._created += create
        if create:
            buf = AlignedBuffer(self.nbytes)
            self._all.append(buf)
            return buf
        return self._free.get()

    def release(self, buf: AlignedBuffer) -> None:
        self._free.put(buf)

    def close(self) -> None:
        for buf in self._all:
            buf.close()
        self._all.clear()


def copy_runs_to(dst: memoryview, runs: Sequence[Run]) -> None:
    pos = 0
    for addr, length in runs:
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(dst, pos)), addr, length)
        pos += length


def copy_to_runs(src: memoryview, runs: Sequence[Run]) -> None:
    pos = 0
    for addr, length in runs:
        ctypes.memmove(addr, ctypes.addressof(ctypes.c_char.from_buffer(src, pos)), length)
        pos += length
