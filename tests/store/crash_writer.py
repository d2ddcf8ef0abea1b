"""A writer process for crash tests: puts seeded pages forever, reporting each acknowledged batch.

Usage: python crash_writer.py DIR SEED PAGE_BYTES CAPACITY_PAGES DURABILITY
After each put returns it prints ``ack <first> <count> <results>`` and flushes, so the parent knows exactly
which pages were acknowledged before it sends SIGKILL at a random moment. Page n's bytes are a pure
function of n (``page_bytes_for``), so the parent can verify any page it is served.
"""

from __future__ import annotations

import sys

import numpy as np

from support import HostMemory, key, open_store


def page_bytes_for(n: int, page_bytes: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, page_bytes, dtype=np.uint8).tobytes()


def main() -> None:
    path, seed, page_bytes, capacity, durability = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), sys.argv[5]
    rng = np.random.default_rng(seed)
    mem = HostMemory(16, page_bytes=page_bytes)
    store = open_store(path, capacity_pages=capacity, page_bytes=page_bytes, durability=durability, eviction="lru",
                       checkpoint_interval=int(rng.integers(5, 40)))
    print("ready", flush=True)
    n = int(rng.integers(0, 1000)) * 1000
    while True:
        count = int(rng.integers(1, 16))
        for j in range(count):
            mem.page(j)[:] = np.frombuffer(page_bytes_for(n + j, page_bytes), dtype=np.uint8)
        ok = store.put([key(n + j) for j in range(count)], [mem.runs(j) for j in range(count)],
                       parent=key(n - 1) if n else None)
        print("ack", n, count, "".join("1" if o else "0" for o in ok), flush=True)
        if rng.random() < 0.2:
            print("del", n, flush=True)  # announced before it happens: a kill may land in between
            store.delete([key(n)])
        n += count


if __name__ == "__main__":
    main()
