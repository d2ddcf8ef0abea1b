"""How a streamed L3 tail is cut into read groups, and how long a forward waits on such a read. Pure Python:
callers pass the figures in.

A page of a streamable pool is stored as ``G`` checksummed layer groups (``parts_plan``); a stream may read them
merged in ``cuts``: read group r is stored groups ``[cuts[r], cuts[r + 1])`` (``parts_plan.ReadPlan``: one IO per
page and K|V range). A read group's *share* is its part of the tail's layers and bytes; the shares sum to 1.

``stall_s`` (the pipeline): the read lands the tail at a steady rate in ``R``; the forward computes its ``c`` layer
by layer and needs read group k once it computed the layers before it, so it waits ``max over k of (R * (s_0 + .. +
s_k) - c * (s_0 + .. + s_(k-1)))``, at least 0 (the k = 0 term is the pipeline's fill).

``read_cuts`` (the cut): the least ``stall_s + read groups x pages x ranges x op_cpu_s`` over every in-order merge of
the stored groups into at least 2 read groups (at most 127 cuts: G <= 8), as every IO also costs a CPU engine's
forward CPU (``op_cpu_s``; 0 where the landing is off the compute's cores); on a tie the most read groups, then even
cuts. Without a compute estimate the cut is even (``read_groups``); with an unknown ``R``, the stored groups as they
are.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from sgl_kvtier.sglang.parts_plan import Cuts as Cuts
from sgl_kvtier.sglang.parts_plan import even_cuts as even_cuts

# CPU seconds a streamed IO costs a CPU engine's forward: above an IO's own CPU, as in a server the landing's IO
# threads also wait for the GIL and the cores behind the forward.
OP_CPU_S = 1e-4


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
