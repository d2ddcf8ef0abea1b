"""In how many read groups a streamed L3 tail is read (issue #13). Pure Python: callers pass the figures in.

A page of a streamable pool is stored as ``G`` layer groups, each checksummed on its own (``parts_plan``);
a stream may read them merged into ``G'`` larger read groups (``parts_plan.ReadPlan``: a read group's parts
of one K|V range are consecutive in the page, one IO per page and range). The trade:

- the forward's first layer needs read group 0 on every page of the tail: it waits about ``R / G'``, with
  ``R`` the hit's predicted read (the store's read model);
- every IO costs CPU on the engine's own cores (the syscall, its completion, the Python around it):
  ``pages x ranges x G'`` IOs of ``op_cpu_s`` each. On a CPU engine those are the forward's cores, so the
  forward pays them: measured on this project's 2-vCPU VM (``benchmarks/bench_landing.py``), landing a
  201 MB hit (96 pages x 2 ranges) took 168 ms of CPU in 8 read groups, 126 ms in 4, 108 in 3, 97 in 2 and
  67 ms read whole, i.e. 0.07-0.1 ms per extra IO, where that hit's forward computes for 0.6-0.8 s; after
  session 18's engine work 122 ms in 8, 102 in 6, 88 in 4, 62 in 2 and 43 whole (0.05-0.06 ms per IO).
  ``OP_CPU_S`` stays at 0.1 ms: in a server the landing's IO threads also wait for the GIL and the cores
  behind the forward, so an IO costs the forward more than its own CPU (6 read groups at break-even).
  Where the landing is off the compute's cores (a GPU forward), ``op_cpu_s`` is 0 and the finest groups win.

So ``G' = argmin over 2..G of  R / G' + pages * ranges * G' * op_cpu_s`` (the finest on a tie). Never fewer
than 2 read groups (one is a whole load with extra steps) unless the pool has fewer layer groups; unknown
or non-finite ``R``: ``G`` (today's reads). On a fast device (``R`` ~0.12 s for 201 MB here) that is 2-3;
at break-even (``R`` ~0.86 s, the hit's compute time) 7-8.
"""

from __future__ import annotations

import math

OP_CPU_S = 1e-4  # CPU seconds per streamed IO on a CPU engine (measured above)


def read_groups(stored_groups: int, read_s: float | None, pages: int, ranges: int,
                op_cpu_s: float = OP_CPU_S) -> int:
    """The read groups of one streamed tail (module docstring)."""
    if stored_groups <= 2 or read_s is None or not math.isfinite(read_s) or read_s < 0:
        return stored_groups
    if not math.isfinite(op_cpu_s) or op_cpu_s <= 0:
        return stored_groups
    ops = max(1, pages) * max(1, ranges) * op_cpu_s  # CPU seconds per read group

    def cost(g: int) -> float:
        return read_s / g + g * ops

    return min(range(stored_groups, 1, -1), key=cost)  # ties: the first seen, the finest
