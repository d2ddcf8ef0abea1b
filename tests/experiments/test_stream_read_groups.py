"""How a streamed tail is cut into read groups, and the pipeline's stall (``experiments.streaming.rules.read_groups``): pure."""

from __future__ import annotations

import itertools
import math

import pytest

from sgl_kvtier.experiments.streaming.rules.read_groups import (
    OP_CPU_S,
    even_cuts,
    read_cuts,
    read_groups,
    shares,
    stall_s,
)

PAGES, RANGES = 96, 2  # a 201 MB kvheavy hit: 96 pages of K and V


def cost(g: int, read_s: float, op_cpu_s: float = OP_CPU_S) -> float:
    return read_s / g + g * PAGES * RANGES * op_cpu_s


def test_a_fast_read_takes_few_large_groups_and_a_slow_one_the_finest():
    fast, breakeven = read_groups(8, 0.12, PAGES, RANGES), read_groups(8, 0.86, PAGES, RANGES)
    assert fast == 3 and breakeven == 7  # the module docstring's two devices
    for read_s, chosen in ((0.12, fast), (0.86, breakeven)):
        assert all(cost(chosen, read_s) <= cost(g, read_s) for g in range(2, 9))
    assert read_groups(8, 30.0, PAGES, RANGES) == 8  # a very slow device: every layer group its own
    assert read_groups(8, 1e-6, PAGES, RANGES) == 2  # never fewer than two (one is a whole load)


def test_a_tie_takes_the_finer_groups():
    # read 6 s over 1 op of 1 s per group: 6/3 + 3 == 6/2 + 2 == 5
    assert read_groups(4, 6.0, 1, 1, op_cpu_s=1.0) == 3


@pytest.mark.parametrize("read_s", [None, math.nan, math.inf, -1.0])
def test_an_unknown_read_keeps_the_pools_groups(read_s):
    assert read_groups(8, read_s, PAGES, RANGES) == 8


@pytest.mark.parametrize("op_cpu_s", [0.0, -1.0, math.nan])
def test_ios_that_cost_the_forward_nothing_keep_the_finest(op_cpu_s):
    assert read_groups(8, 0.12, PAGES, RANGES, op_cpu_s=op_cpu_s) == 8


@pytest.mark.parametrize("stored", [1, 2])
def test_a_pool_of_two_groups_or_fewer_is_read_as_stored(stored):
    assert read_groups(stored, 0.12, PAGES, RANGES) == stored


# ---------------------------------------------------------------------------------------------- uneven cuts
KVHEAVY = tuple(range(0, 65, 8))  # 64 layers stored in 8 groups of 8


def total(cuts, read_s: float, compute_s: float, op_cpu_s: float = OP_CPU_S) -> float:
    """What ``read_cuts`` minimises: the forward's waits plus the read groups' IO CPU."""
    return stall_s(shares(KVHEAVY, cuts), read_s, compute_s) + (len(cuts) - 1) * PAGES * RANGES * op_cpu_s


def test_even_cuts_and_shares():
    assert even_cuts(10, 4) == (0, 2, 5, 7, 10) and even_cuts(8, 8) == tuple(range(9)) and even_cuts(8, 1) == (0, 8)
    assert shares(KVHEAVY, (0, 1, 3, 8)) == (0.125, 0.25, 0.625)
    assert shares((0, 15, 31, 46, 62), (0, 2, 4)) == pytest.approx((31 / 62, 31 / 62))  # stored groups of 15-16


def test_the_stall_of_even_groups_is_the_fill_or_what_the_compute_leaves_over():
    even = (0.25,) * 4
    assert stall_s(even, 0.4, 1.0) == pytest.approx(0.1)  # fast read: group 0's fill, R / G
    assert stall_s(even, 2.0, 1.0) == pytest.approx(2.0 - 0.75)  # slow read: R - (1 - 1/G) c
    assert stall_s(even, 0.0, 1.0) == 0.0 and stall_s((1.0,), 0.3, 5.0) == pytest.approx(0.3)  # one group: all of it
    # a small group 0 fills sooner; a large one after it must still land before the compute needs it
    assert stall_s((0.125, 0.25, 0.625), 0.12, 0.47) == pytest.approx(0.015)
    assert stall_s((0.125, 0.875), 0.12, 0.47) == pytest.approx(0.12 - 0.47 / 8)  # group 1 lands late


def test_the_stall_counts_from_what_landed_and_leaves_out_early_groups():
    even = (0.25,) * 4
    # half landed: 0.5 s lands the other half; group 2 at 0.25 s, needed after 0.5 c; group 3 at 0.5 s, after 0.75 c
    assert stall_s(even, 0.5, 0.4, landed=0.5) == pytest.approx(max(0.25 - 0.2, 0.5 - 0.3))
    assert stall_s(even, 0.5, 10.0, landed=1.0) == 0.0  # nothing left to land
    assert stall_s(even, 1.0, 1.0, first=1) == pytest.approx(0.25)  # group 0's fill left out: the last's R - 0.75 c
    assert stall_s(even, 0.4, 1.0, first=1) == 0.0


def test_a_fast_read_cuts_a_small_group_0_and_few_large_ios():
    cuts = read_cuts(KVHEAVY, 0.12, 0.47, PAGES, RANGES)  # kvheavy on the fast device (module docstring)
    assert cuts[1] <= 2 and len(cuts) - 1 <= 3
    even = even_cuts(8, read_groups(8, 0.12, PAGES, RANGES))
    assert total(cuts, 0.12, 0.47) < total(even, 0.12, 0.47) - 0.015  # fill cut, the IOs no more
    assert stall_s(shares(KVHEAVY, cuts), 0.12, 0.47) <= 0.12 * cuts[1] / 8 + 1e-12  # only the fill is waited


def test_a_slow_read_ends_in_a_small_group():
    cuts = read_cuts(KVHEAVY, 0.86, 0.55, PAGES, RANGES)  # break-even: the read outlasts the compute
    assert cuts[-2] == 7  # what the forward computes after the read ended: one stored group
    assert total(cuts, 0.86, 0.55) < total(even_cuts(8, read_groups(8, 0.86, PAGES, RANGES)), 0.86, 0.55)


@pytest.mark.parametrize("read_s, compute_s", [(0.12, 0.47), (0.3, 0.5), (0.86, 0.55), (2.0, 0.5), (1e-4, 1.0)])
def test_the_cut_is_the_cheapest_of_every_way_to_merge_the_groups(read_s, compute_s):
    every = [(0, *c, 8) for n in range(1, 8) for c in itertools.combinations(range(1, 8), n)]
    best = min(total(c, read_s, compute_s) for c in every)
    cuts = read_cuts(KVHEAVY, read_s, compute_s, PAGES, RANGES)
    assert total(cuts, read_s, compute_s) == pytest.approx(best) and len(cuts) >= 3


def test_where_ios_cost_the_forward_nothing_the_cut_is_the_finest():
    for read_s in (0.12, 0.86, 5.0):
        assert read_cuts(KVHEAVY, read_s, 0.5, PAGES, RANGES, op_cpu_s=0.0) == tuple(range(9))


@pytest.mark.parametrize("compute_s", [None, math.nan, -1.0])
def test_without_a_compute_estimate_the_cut_is_even(compute_s):
    assert read_cuts(KVHEAVY, 0.12, compute_s, PAGES, RANGES) == even_cuts(8, 3)  # read_groups' 3
    assert read_cuts(KVHEAVY, None, compute_s, PAGES, RANGES) == tuple(range(9))


@pytest.mark.parametrize("read_s", [None, math.inf, -1.0])
def test_an_unknown_read_is_cut_as_stored(read_s):
    assert read_cuts(KVHEAVY, read_s, 0.5, PAGES, RANGES) == tuple(range(9))
    assert read_cuts((0, 3, 6), 0.12, 0.5, PAGES, RANGES) == (0, 1, 2)  # two stored groups: as stored
