"""Host memory for store-level benchmarks, laid out like SGLang's ``page_first`` host pool."""

from __future__ import annotations

import numpy as np

from sgl_kvtier.config import MiB
from sgl_kvtier.io.buffers import AlignedBuffer

Runs = list[tuple[int, int]]


class HostPool:
    """``slots`` page slots of prefaulted aligned memory: all K halves, then all V halves; a page is 2 runs.

    With ``rng`` the pool starts as random bytes (write sources), otherwise zeroed.
    """

    def __init__(self, page_bytes: int, slots: int, rng: np.random.Generator | None = None):
        self.page_bytes, self.half, self.slots = page_bytes, page_bytes // 2, slots
        self.buf = AlignedBuffer(page_bytes * slots)
        self.bytes = np.frombuffer(self.buf.view, dtype=np.uint8)
        words = self.bytes.view(np.uint64)
        for start in range(0, words.size, 8 * MiB):  # filled in chunks: no big temporaries, every page touched
            chunk = words[start:start + 8 * MiB]
            chunk[:] = rng.integers(0, 1 << 63, size=chunk.size, dtype=np.uint64) if rng is not None else 0

    def runs(self, slot: int) -> Runs:
        """Slot ``slot`` as [(K address, length), (V address, length)]."""
        base = self.buf.address + slot * self.half
        return [(base, self.half), (base + self.slots * self.half, self.half)]

    def pages(self, rng: np.random.Generator, n: int) -> list[Runs]:
        """``n`` distinct slots at random (scattered) positions, as the host allocator hands them out."""
        return [self.runs(int(s)) for s in rng.permutation(self.slots)[:n]]

    def _halves(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        k = slot * self.half
        v = self.slots * self.half + k
        return self.bytes[k:k + self.half], self.bytes[v:v + self.half]

    def read(self, slot: int) -> bytes:
        """The page in ``slot``: its K half then its V half."""
        k, v = self._halves(slot)
        return k.tobytes() + v.tobytes()

    def write(self, slot: int, data: bytes) -> None:
        """Put ``data`` (one page: K half then V half) into ``slot``."""
        k, v = self._halves(slot)
        page = np.frombuffer(data, dtype=np.uint8)
        k[:], v[:] = page[:self.half], page[self.half:]

    def clear(self) -> None:
        self.bytes[:] = 0
