"""Caller memory as buffers, and aligned scratch memory for O_DIRECT.

Callers (SGLang's host pool) hand pages over as *runs*: ``(address, length)`` pairs into memory they own
and keep alive for the duration of the call. ``view`` wraps a run as a writable memoryview without copying:
a slice of one memoryview spanning the process's address space (``_ADDRESS_SPACE``; making it maps and
touches nothing), which is far cheaper than a ctypes array object per run.

O_DIRECT needs buffer addresses, lengths and file offsets aligned to the device's logical block size;
``ALIGN`` = 4096 covers every device. A page whose runs are not all aligned moves through a ``BouncePool``
buffer (one memcpy) instead of being refused.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from collections.abc import Sequence

ALIGN = 4096

Run = tuple[int, int]  # (address, length in bytes)
_ADDRESS_SPACE = memoryview((ctypes.c_ubyte * sys.maxsize).from_address(0)).cast("B")


def view(address: int, length: int) -> memoryview:
    """A writable, zero-copy view of ``length`` bytes at ``address`` (which the caller keeps alive)."""
    if address <= 0 or length < 0 or address + length > sys.maxsize:
        raise ValueError(f"no memory at address {address:#x} for {length} bytes")
    return _ADDRESS_SPACE[address:address + length]


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
    """A fixed set of ``count`` aligned buffers of one size, handed out to IO batches.

    A batch takes all the buffers it needs at once (``acquire_many``): two batches that each took a part of
    the pool one buffer at a time and waited for the rest would wait for each other forever.
    """

    def __init__(self, nbytes: int, count: int):
        self.nbytes = round_up(nbytes)
        self.count = max(1, count)
        self._free: list[AlignedBuffer] = []
        self._all: list[AlignedBuffer] = []
        self._cond = threading.Condition()

    def acquire(self) -> AlignedBuffer:
        """One buffer; blocks while all are in use."""
        return self.acquire_many(1)[0]

    def acquire_many(self, n: int) -> list[AlignedBuffer]:
        """``n`` buffers (at most ``count``), taken together; blocks until that many are free."""
        if not 0 <= n <= self.count:
            raise ValueError(f"asked for {n} bounce buffers of a pool of {self.count}")
        with self._cond:
            while len(self._free) + (self.count - len(self._all)) < n:
                self._cond.wait()
            while len(self._free) < n:  # made lazily: a pool that never bounces costs no memory
                buf = AlignedBuffer(self.nbytes)
                self._all.append(buf)
                self._free.append(buf)
            taken, self._free[len(self._free) - n:] = self._free[len(self._free) - n:], []
            return taken

    def release(self, buf: AlignedBuffer) -> None:
        """Give one buffer back (wakes a batch waiting for buffers)."""
        with self._cond:
            self._free.append(buf)
            self._cond.notify_all()

    def close(self) -> None:
        """Free every buffer (the pool must be idle)."""
        with self._cond:
            for buf in self._all:
                buf.close()
            self._all.clear()
            self._free.clear()


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
