"""The writer process of the crash harness: puts seeded pages forever, reporting each acknowledged batch.

Usage: ``python -m benchmarks.store.crash_writer DIR SEED DURABILITY``. After each put returns it prints
``ack <first> <count> <results>`` and flushes, so the parent knows exactly which pages were acknowledged
before it sends SIGKILL at a random moment; a delete is announced (``del <n>``) before it happens.
"""

from __future__ import annotations

import sys

import numpy as np

from benchmarks.store.crash import PAGE, key, open_small, page_bytes_for
from benchmarks.store.hostpool import HostPool


def main() -> None:
    path, seed, durability = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rng = np.random.default_rng(seed)
    mem = HostPool(PAGE, 16)
    store = open_small(path, durability=durability, eviction="lru", checkpoint_interval=int(rng.integers(5, 40)))
    print("ready", flush=True)
    n = int(rng.integers(0, 1000)) * 1000
    while True:
        count = int(rng.integers(1, 16))
        for j in range(count):
            mem.write(j, page_bytes_for(n + j))
        ok = store.put([key(n + j) for j in range(count)], [mem.runs(j) for j in range(count)],
                       parent=key(n - 1) if n else None)
        print("ack", n, count, "".join("1" if o else "0" for o in ok), flush=True)
        if rng.random() < 0.2:
            print("del", n, flush=True)  # announced before it happens: a kill may land in between
            store.delete([key(n)])
        n += count


if __name__ == "__main__":
    main()
