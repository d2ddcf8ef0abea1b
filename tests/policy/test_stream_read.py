"""In how many read groups a streamed tail is read (``policy.stream_read``): pure, every branch."""

from __future__ import annotations

import math

import pytest

from sgl_kvtier.policy.stream_read import OP_CPU_S, read_groups

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
