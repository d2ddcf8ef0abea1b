"""How a streamed L3 tail is cut into read groups (issue #13), and how long a forward waits on such a read.
Pure Python: callers pass the figures in.

A page of a streamable pool is stored as ``G`` layer groups, each checksummed on its own (``parts_plan``);
a stream may read them merged into fewer, larger read groups: ``cuts`` over the stored groups, read group r
being stored groups ``[cuts[r], cuts[r + 1])`` (``parts_plan.ReadPlan``: a read group's parts of one K|V
range are consecutive in the page, one IO per page and range). Each read group has a *share* of the tail's
layers and bytes (its stored groups' layers over all; the shares sum to 1).

**The pipeline** (``stall_s``): the read lands the tail at a steady rate, group after group, in ``R``; the
forward computes its ``c`` at a steady rate layer after layer, and needs read group k once it computed the
layers before it. Started together, the forward waits ``max over k of (R * (s_0 + .. + s_k) - c * (s_0 + ..
+ s_(k-1)))`` in all (at least 0): the k = 0 term is the pipeline's fill (group 0 lands before layer 0
computes), the last one what a read slower than the compute leaves over. ``stream_bind`` prices a stream
with it, ``stream_gate`` admits a tail once its groups after the first no longer make the forward wait.

**The cut** (``read_cuts``): every IO also costs CPU on the engine's own cores (the syscall, its completion,
the Python around it): ``pages x ranges`` IOs of ``op_cpu_s`` per read group. On a CPU engine those are the
forward's cores, so the forward pays them: measured on this project's 2-vCPU VM (``bench_landing``), landing
a 201 MB hit (96 pages x 2 ranges) took 168 ms of CPU in 8 read groups, 126 ms in 4, 108 in 3, 97 in 2 and
67 ms read whole, i.e. 0.07-0.1 ms per extra IO, where that hit's forward computes for 0.6-0.8 s; after
session 18's engine work 122 ms in 8, 102 in 6, 88 in 4, 62 in 2 and 43 whole (0.05-0.06 ms per IO).
``OP_CPU_S`` stays at 0.1 ms: in a server the landing's IO threads also wait for the GIL and the cores
behind the forward, so an IO costs the forward more than its own CPU. Where the landing is off the
compute's cores (a GPU forward), ``op_cpu_s`` is 0 and the finest cut wins.

So the cut is the one of least ``stall_s + read groups x pages x ranges x op_cpu_s`` over every way to merge
the stored groups in order into at least 2 read groups (``2^(G-1) - 1`` cuts, at most 127: G <= 8); on a
tie the most read groups, then even cuts. The groups need not be even: where the read is faster than the
compute (``R < c``) the fill is the only wait, so a small group 0 and larger ones after it cost the fewest
IOs for the least fill (kvheavy on the fast device, R 0.12 s, c 0.47 s: ``(0, 2, 8)``, the 30 ms fill of
the 3 even groups ``(0, 2, 5, 8)`` in a third fewer IOs); where it is slower, what the forward computes
after the last group lands is the wait, so the last group is small and the ones before it may be large
(break-even, R 0.86 s, c 0.55 s: ``(0, 1, 4, 6, 7, 8)`` against the even ``(0, 1, 2, 3, 4, 5, 6, 8)``,
whose last group of 2 leaves 69 ms more to compute after the read). Measured against even cuts in the same
run (``benchmarks/RESULTS.md``, session 20): 0-4% lower TTFT at break-even, the forward's waits on groups
halved. Without a compute estimate ``c`` the cut is even, in ``read_groups(..)`` groups (``R / G' + G' x
pages x ranges x op_cpu_s``, the finest on a tie: on a fast device 2-3, at break-even 7-8); unknown or
non-finite ``R``: the stored groups as they are.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from sgl_kvtier.sglang.parts_plan import Cuts as Cuts
from sgl_kvtier.sglang.parts_plan import even_cuts as even_cuts

OP_CPU_S = 1e-4  # CPU seconds per streamed IO on a CPU engine (measured above)


def shares(layer_bounds: Sequence[int], cuts: Sequence[int]) -> tuple[float, ...]:
    """Each read group's share of the layers (= of the bytes) of pages stored in groups of ``layer_bounds``
    (stored group g: layers ``[layer_bounds[g], layer_bounds[g + 1])``), read in ``cuts``."""
    total = layer_bounds[-1] - layer_bounds[0]
    return tuple((layer_bounds[b] - layer_bounds[a]) / total for a, b in zip(cuts, cuts[1:]))


def or_even(group_shares: tuple[float, ...], groups: int) -> tuple[float, ...]:
    """``group_shares``, or ``groups`` even shares where it is empty (the callers' inputs' default)."""
    return group_shares or (1.0 / groups,) * groups


def check_shares(group_shares: Sequence[float], groups: int) -> None:
    """Raises ValueError unless ``group_shares`` is empty (even) or ``groups`` positive shares summing to 1."""
    if group_shares and (len(group_shares) != groups or not math.isclose(sum(group_shares), 1.0)
                         or min(group_shares) <= 0):
        raise ValueError(f"shares must be {groups} positive shares summing to 1, got {tuple(group_shares)}")


def stall_s(group_shares: Sequence[float], read_s: float, compute_s: float, landed: float = 0.0,
            first: int = 0) -> float:
    """Seconds the forward waits on the read in all (module docstring, "the pipeline"), at least 0.

    ``read_s`` lands what is not landed yet: ``landed`` is the leading share already there (0..1), so group k
    lands ``read_s * (s_0 + .. + s_k - landed) / (1 - landed)`` from now. Groups that landed whole, and those
    before ``first``, are left out (the gate leaves group 0 out: the forward waits on it either way).
    """
    rest = 1.0 - landed
    if read_s <= 0 or rest <= 1e-12:
        return 0.0
    worst, done = 0.0, 0.0
    for k, share in enumerate(group_shares):
        before, done = done, done + share
        if k >= first and done - landed > 1e-12:
            worst = max(worst, read_s * (done - landed) / rest - compute_s * before)
    return worst


def read_groups(stored_groups: int, read_s: float | None, pages: int, ranges: int,
                op_cpu_s: float = OP_CPU_S) -> int:
    """How many even read groups, without a compute estimate (module docstring)."""
    if stored_groups <= 2 or read_s is None or not math.isfinite(read_s) or read_s < 0:
        return stored_groups
    if not math.isfinite(op_cpu_s) or op_cpu_s <= 0:
        return stored_groups
    ops = max(1, pages) * max(1, ranges) * op_cpu_s  # CPU seconds per read group

    def cost(g: int) -> float:
        return read_s / g + g * ops

    return min(range(stored_groups, 1, -1), key=cost)  # ties: the first seen, the finest


def read_cuts(layer_bounds: Sequence[int], read_s: float | None, compute_s: float | None, pages: int,
              ranges: int, op_cpu_s: float = OP_CPU_S) -> Cuts:
    """The cut of one streamed tail (module docstring): ``layer_bounds`` are the stored layer groups'."""
    stored = len(layer_bounds) - 1
    if compute_s is None or not math.isfinite(compute_s) or compute_s < 0:
        return even_cuts(stored, read_groups(stored, read_s, pages, ranges, op_cpu_s))
    if stored <= 2 or read_s is None or not math.isfinite(read_s) or read_s < 0:
        return even_cuts(stored, stored)
    op_cpu = op_cpu_s if math.isfinite(op_cpu_s) and op_cpu_s > 0 else 0.0
    per_group = max(1, pages) * max(1, ranges) * op_cpu

    def key(cuts: Cuts) -> tuple[float, int, bool]:
        cost = stall_s(shares(layer_bounds, cuts), read_s, compute_s) + (len(cuts) - 1) * per_group
        return round(cost, 9), -len(cuts), cuts != even_cuts(stored, len(cuts) - 1)

    inner = range(1, stored)
    every = (c for n in range(1, stored) for c in itertools.combinations(inner, n))
    return min(((0, *c, stored) for c in every), key=key)
