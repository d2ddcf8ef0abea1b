"""The T_hide admission rule of a streamed tail (``experiments.streaming.rules.gate``): pure, every branch."""

from __future__ import annotations

import math

import pytest

from sgl_kvtier.experiments.streaming.rules.gate import (
    GateInputs,
    Verdict,
    decide,
    predicted_read_s,
    read_rate_Bps,
    stall_after_admission_s,
)


def inputs(**kw) -> GateInputs:
    base = dict(groups=4, remaining_bytes=1_000_000, group0_landed=False, failed=False, waited_s=0.0,
                deadline_s=10.0)
    base.update(kw)
    return GateInputs(**base)


def test_hides_under_the_suffix_compute():
    # 1 MB at 10 MB/s = 0.1 s; (1 - 1/4) * 0.2 s = 0.15 s of compute hides it
    assert decide(inputs(read_rate_Bps=1e7, suffix_compute_s=0.2, full_compute_s=1.0)) is Verdict.READY
    # exactly at the budget: admitted
    assert decide(inputs(read_rate_Bps=1e7, suffix_compute_s=0.1 / 0.75, full_compute_s=1.0)) is Verdict.READY


def test_waits_while_the_read_is_longer_but_streaming_still_wins():
    # 0.1 s of read, 0.1 s of suffix compute (hides 0.075 s): wait; streamed TTFT 0.1 + 0.025 < 1.0 recompute
    assert decide(inputs(read_rate_Bps=1e7, suffix_compute_s=0.1, full_compute_s=1.0)) is Verdict.WAIT


def test_the_landing_s_interference_lengthens_the_forward_it_hides_under():
    # 0.1 s of read; 0.1 s of suffix compute hides 0.075 s (wait), with 0.05 s of interference 0.1125 s (admit)
    assert decide(inputs(read_rate_Bps=1e7, suffix_compute_s=0.1)) is Verdict.WAIT
    admitted = inputs(read_rate_Bps=1e7, suffix_compute_s=0.1, interference_s=0.05)
    assert decide(admitted) is Verdict.READY
    assert admitted.forward_s() == pytest.approx(0.15) and stall_after_admission_s(admitted, 0.1, 0.15) == 0.0
    assert stall_after_admission_s(admitted, 0.1, 0.1) == pytest.approx(0.025)  # the last group: 0.1 - 0.075
    assert inputs().forward_s() is None and inputs(interference_s=1.0).forward_s() is None  # no model: unknown


def test_interference_counts_in_the_streamed_ttft_against_recomputing():
    # 1 s of read, c = 0.1 + 0.3: streamed TTFT max(1.0, 0.3) + 0.1 = 1.1 > 1.05 recompute: drop; 0.0: 1.025, wait
    slow = dict(read_rate_Bps=1e6, suffix_compute_s=0.1, full_compute_s=1.05)
    assert decide(inputs(**slow, interference_s=0.3)) is Verdict.DROP
    assert decide(inputs(**slow)) is Verdict.WAIT


def test_before_a_second_landing_the_stores_bandwidth_lifts_the_streams_rate():
    # 1 MB: at the stream's 5 MB/s from its start 0.2 s (waits); at the store's measured 10 MB/s 0.1 s (admitted)
    early = dict(read_rate_Bps=5e6, rate_settled=False, device_rate_Bps=1e7, suffix_compute_s=0.2)
    assert read_rate_Bps(inputs(**early, group0_landed=True)) == 1e7
    assert decide(inputs(**early, group0_landed=True)) is Verdict.READY
    assert decide(inputs(**early)) is Verdict.WAIT  # group 0 not landed on every page: the stream's own rate
    assert decide(inputs(**{**early, "rate_settled": True}, group0_landed=True)) is Verdict.WAIT  # settled: its own
    assert decide(inputs(**{**early, "device_rate_Bps": None}, group0_landed=True)) is Verdict.WAIT
    # the higher of the two: a stream faster than the store's figure keeps its own; no stream rate yet: the store's
    assert read_rate_Bps(inputs(**{**early, "read_rate_Bps": 2e7}, group0_landed=True)) == 2e7
    assert read_rate_Bps(inputs(**{**early, "read_rate_Bps": None}, group0_landed=True)) == 1e7
    assert read_rate_Bps(inputs(**{**early, "device_rate_Bps": math.nan}, group0_landed=True)) == 5e6


def test_busy_waits_for_the_whole_tail_as_a_whole_load_would():
    hides = dict(read_rate_Bps=1e12, suffix_compute_s=10.0, group0_landed=True)
    assert decide(inputs(**hides)) is Verdict.READY
    assert decide(inputs(**hides, busy=True)) is Verdict.WAIT  # others share the engine: not before it landed
    assert decide(inputs(**hides, busy=True, remaining_bytes=0)) is Verdict.READY
    assert decide(inputs(busy=True, failed=True)) is Verdict.DROP
    assert decide(inputs(busy=True, waited_s=10.0)) is Verdict.DROP  # the deadline still holds


def test_drops_when_recomputing_is_faster():
    # 10 s of read against 0.3 s to recompute tail + suffix
    assert decide(inputs(read_rate_Bps=1e5, suffix_compute_s=0.1, full_compute_s=0.3)) is Verdict.DROP


def test_a_failed_group_drops_whatever_else():
    assert decide(inputs(failed=True, remaining_bytes=0, group0_landed=True)) is Verdict.DROP
    assert decide(inputs(failed=True, read_rate_Bps=1e12, suffix_compute_s=10.0)) is Verdict.DROP


def test_everything_landed_is_ready_even_past_the_deadline():
    assert decide(inputs(remaining_bytes=0, waited_s=99.0)) is Verdict.READY


def test_the_deadline_drops():
    assert decide(inputs(waited_s=10.0, group0_landed=True)) is Verdict.DROP
    assert decide(inputs(waited_s=9.99, group0_landed=True)) is Verdict.READY


@pytest.mark.parametrize("rate, compute", [(None, 0.2), (1e7, None), (0.0, 0.2), (math.nan, 0.2), (None, None)])
def test_unmeasured_inputs_fall_back_to_group_zero(rate, compute):
    assert decide(inputs(read_rate_Bps=rate, suffix_compute_s=compute)) is Verdict.WAIT
    assert decide(inputs(read_rate_Bps=rate, suffix_compute_s=compute, group0_landed=True)) is Verdict.READY


def test_one_group_hides_nothing():
    assert stall_after_admission_s(inputs(groups=1), 1e-6, 5.0) == pytest.approx(1e-6)  # the only group: waited
    assert decide(inputs(groups=1, read_rate_Bps=1e12, suffix_compute_s=5.0, full_compute_s=9.0)) is Verdict.WAIT


def test_helpers_and_validation():
    assert predicted_read_s(inputs(remaining_bytes=0)) == 0.0
    assert predicted_read_s(inputs(read_rate_Bps=2e6)) == pytest.approx(0.5)
    assert predicted_read_s(inputs()) is None
    assert inputs(suffix_compute_s=-1.0).forward_s() == 0.0
    with pytest.raises(ValueError):
        inputs(groups=0)
    with pytest.raises(ValueError):
        inputs(remaining_bytes=-1)
    for bad in (-0.1, math.nan):
        with pytest.raises(ValueError, match="interference_s"):
            inputs(interference_s=bad)


def test_uneven_groups_wait_for_the_group_that_would_land_late():
    # 1 MB at 10 MB/s (0.1 s), group 0 landed (1/8 of the tail), c = 0.2 s; (0, 1, 3, 8) of 8 layer groups
    small_first = (0.125, 0.25, 0.625)
    base = dict(read_rate_Bps=1e7, suffix_compute_s=0.2, group0_landed=True, groups=3, tail_bytes=8_000_000,
                remaining_bytes=7_000_000)
    # 7 MB left: group 1 lands at 0.2 s, needed at 0.025 s: waits; the last's (1 - 0.625) c = 0.075 s too
    assert decide(inputs(**base, shares=small_first)) is Verdict.WAIT
    ready = {**base, "remaining_bytes": 1_000_000, "read_rate_Bps": 2e7}  # 0.05 s left, groups 1-2 in flight
    # landed 7/8: the rest (the last group's) lands at 0.05 s, needed after 0.375 c = 0.075 s: admitted
    assert decide(inputs(**ready, shares=small_first)) is Verdict.READY
    # a large middle group that lands after the compute reached it: waits where the last group alone would not
    middle = (0.125, 0.75, 0.125)
    late = {**base, "read_rate_Bps": 7e7, "suffix_compute_s": 0.45}  # 0.1 s left; the last group needed at 0.39 s
    assert decide(inputs(**late, shares=middle)) is Verdict.WAIT  # group 1 lands at 0.086 s, needed at 0.056 s
    # group 1 at 0.014 s (needed at 0.056 s), group 2 at 0.1 s (needed at 0.1125 s)
    assert decide(inputs(**late, shares=(0.125, 0.125, 0.75))) is Verdict.READY


def test_the_landed_share_comes_from_the_tails_bytes_and_group_0():
    assert inputs(groups=4, group0_landed=True).landed_share() == 0.25  # bytes unknown: group 0
    assert inputs(groups=4).landed_share() == 0.0
    assert inputs(groups=4, tail_bytes=4_000_000, remaining_bytes=1_000_000).landed_share() == 0.75
    assert inputs(groups=4, tail_bytes=4_000_000, remaining_bytes=3_900_000, group0_landed=True).landed_share() == 0.25


def test_before_group_0_landed_only_the_last_group_is_checked():
    # uneven, group 0 not landed: 0.1 s of read against (1 - 0.625) x 0.3 s = 0.1125 s before the last group
    early = dict(read_rate_Bps=1e7, suffix_compute_s=0.3, groups=3, shares=(0.125, 0.25, 0.625))
    assert decide(inputs(**early)) is Verdict.READY
    assert decide(inputs(**{**early, "suffix_compute_s": 0.25})) is Verdict.WAIT  # 0.094 s: the last lands late
    assert stall_after_admission_s(inputs(**early), 0.1, 0.25) == pytest.approx(0.1 - 0.375 * 0.25)


def test_the_streamed_ttft_against_recomputing_counts_the_uneven_stall():
    # 1 s of read, group 0 landed, c = 0.2 s, last group 0.625: stall 1 - 0.375 x 0.2 = 0.925, TTFT 1.125
    slow = dict(read_rate_Bps=1e6, suffix_compute_s=0.2, group0_landed=True, groups=3, shares=(0.125, 0.25, 0.625))
    assert decide(inputs(**slow, full_compute_s=1.1)) is Verdict.DROP
    assert decide(inputs(**slow, full_compute_s=1.2)) is Verdict.WAIT


@pytest.mark.parametrize("bad", [(0.5, 0.5), (0.5, 0.25, 0.2), (1.0, 0.0, 0.0), (1.5, -0.25, -0.25)])
def test_shares_must_be_one_per_group_and_sum_to_one(bad):
    with pytest.raises(ValueError, match="shares"):
        inputs(groups=3, shares=bad)
