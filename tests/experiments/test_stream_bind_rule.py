"""The bind-time rule of a streamed tail: stream only where the overlap is predicted to pay, learned figures."""

from __future__ import annotations

import itertools
import math

import pytest

from sgl_kvtier.experiments.streaming.rules.bind import (
    HIT_WINDOW,
    MAX_PENDING,
    BindInputs,
    BindVerdict,
    StreamCosts,
    decide,
)

MB = 1_000_000
HIT = 200 * MB  # the benchmark's hit: 201 MB of KV
SHAPE = [(64, 1536)]  # a streamed hit's batch: 64 new tokens over 1,536 cached
RIDS = itertools.count()


def PREDICT(shape: list[tuple[int, int]]) -> float:  # noqa: N802 - a constant-like prefill model
    return 0.5  # the prefill model's batch time for SHAPE


def inputs(read_s: float | None, c: float | None = 0.5, whole: float | None = None, k_per_mb: float | None = 0.0,
           groups: int = 4) -> BindInputs:
    return BindInputs(HIT, groups, read_s, c, whole, None if k_per_mb is None else k_per_mb / MB)


def test_unmeasured_inputs_stream():
    assert decide(inputs(None)).verdict is BindVerdict.STREAM
    assert decide(inputs(0.5, c=None)).verdict is BindVerdict.STREAM
    assert decide(inputs(0.5, k_per_mb=None)).reason == "calibrating: streamed"  # how k gets measured


def test_a_slow_device_streams_and_a_fast_one_on_a_busy_cpu_loads_whole():
    # the two devices of benchmarks/bench_streaming, k as measured with it on a 2-vCPU VM (~1.6 ms of forward
    # per MB of tail)
    # (k x 200 MB = 0.32 s lengthens the forward the read hides under: (1 - 1/4) x (0.5 + 0.32) = 0.615 s > R)
    slow = decide(inputs(0.54, whole=0.77, k_per_mb=1.6e-3))
    fast = decide(inputs(0.15, whole=0.36, k_per_mb=1.6e-3))
    assert slow.verdict is BindVerdict.STREAM and slow.gain_s == pytest.approx(0.77 - 0.54 / 4 - 0.32)
    assert fast.verdict is BindVerdict.WHOLE and fast.gain_s == pytest.approx(0.36 - 0.0375 - 0.32)
    # on a GPU the copies are DMA (k ~ 0): a fast device's read still hides under the suffix
    assert decide(inputs(0.15, whole=0.2, k_per_mb=0.0)).verdict is BindVerdict.STREAM


def test_the_gain_must_be_a_share_of_the_whole_load_ttft():
    # W = R = 0.1 s, the gate waits R / G = 0.025 s: gain 0.075 s of a 0.6 s TTFT (12.5%)
    assert decide(inputs(0.1, whole=0.1), min_gain_share=0.10).verdict is BindVerdict.STREAM
    assert decide(inputs(0.1, whole=0.1), min_gain_share=0.15).verdict is BindVerdict.WHOLE


def test_without_a_learned_whole_wait_the_predicted_read_stands_in():
    assert decide(inputs(0.54, k_per_mb=1.6e-3)).gain_s == pytest.approx(0.54 - 0.54 / 4 - 0.32)


def test_the_interference_lengthens_the_forward_the_read_hides_under():
    # R = 1 s, c = 0.5 s: without k the gate waits 1 - 0.375 = 0.625 s; k x 200 MB = 0.4 s hides 0.3 s more
    assert decide(inputs(1.0, whole=2.0, k_per_mb=0.0)).gain_s == pytest.approx(2.0 - 0.625)
    assert decide(inputs(1.0, whole=2.0, k_per_mb=2e-3)).gain_s == pytest.approx(2.0 - (1.0 - 0.75 * 0.9) - 0.4)


def test_the_gain_is_priced_in_the_read_groups_shares():
    # R = 0.12 s, c = 0.47 s, W = 0.12 s: even 2 groups wait a 0.06 s fill, a small group 0 of 1/8 0.015 s
    even = BindInputs(HIT, 2, 0.12, 0.47, 0.12, 0.0)
    assert decide(even).gain_s == pytest.approx(0.12 - 0.06)
    assert decide(BindInputs(HIT, 2, 0.12, 0.47, 0.12, 0.0, shares=(0.125, 0.875))).gain_s == pytest.approx(
        0.12 - (0.12 - 0.47 / 8))  # group 1 (7/8) lands at 0.12 s, needed after 0.059 s: waited for
    small_first = BindInputs(HIT, 3, 0.12, 0.47, 0.12, 0.0, shares=(0.125, 0.25, 0.625))
    assert decide(small_first).gain_s == pytest.approx(0.12 - 0.015)  # the fill only
    costs = StreamCosts(explore_every=0)
    for _ in range(2):
        costs.record_stream_forward(HIT, SHAPE, 0.5)  # as predicted: k = 0
    assert costs.decide(HIT, 3, 0.12, 0.47, PREDICT).gain_s == pytest.approx(0.12 - 0.04)  # even thirds
    assert costs.decide(HIT, 3, 0.12, 0.47, PREDICT, shares=(0.125, 0.25, 0.625)).gain_s == pytest.approx(0.105)
    with pytest.raises(ValueError, match="shares"):
        BindInputs(HIT, 3, 0.12, 0.47, shares=(0.5, 0.5))


def test_bad_inputs_are_refused_and_nan_is_unmeasured():
    with pytest.raises(ValueError, match="groups"):
        BindInputs(HIT, 0, 0.1, 0.1)
    with pytest.raises(ValueError, match="hit_bytes"):
        BindInputs(-1, 4, 0.1, 0.1)
    assert decide(inputs(math.nan)).verdict is BindVerdict.STREAM


def test_costs_learn_whole_wait_and_interference():
    costs = StreamCosts(explore_every=0)
    assert costs.whole_wait_s(HIT) is None and costs.interference_s_per_byte(PREDICT) is None
    for mb, s in ((100, 0.2), (200, 0.36), (300, 0.52)):  # 0.04 s + 1.6 ms / MB
        costs.record_whole(mb * MB, s)
    assert costs.whole_wait_s(HIT) == pytest.approx(0.36)
    costs.record_stream_forward(100 * MB, SHAPE, 0.5 + 0.16)  # the model says 0.5 s for this batch
    assert costs.interference_s_per_byte(PREDICT) is None  # one sample is not enough
    costs.record_stream_forward(200 * MB, SHAPE, 0.5 + 0.32)
    assert costs.interference_s_per_byte(PREDICT) == pytest.approx(1.6e-3 / MB)
    assert costs.interference_s_per_byte(None) is None  # no prefill model: k cannot be judged
    costs.record_stream_forward(0, SHAPE, 5.0)  # no bytes: ignored
    costs.record_whole(HIT, math.inf)  # not finite: ignored
    snap = costs.snapshot(PREDICT)
    assert snap.whole_samples == 3 and snap.interference_samples == 2
    assert snap.whole_wait_fixed_s == pytest.approx(0.04) and snap.whole_wait_s_per_mb == pytest.approx(1.6e-3)
    assert snap.interference_s_per_mb == pytest.approx(1.6e-3) and costs.snapshot().interference_s_per_mb is None
    fresh = StreamCosts().snapshot()
    assert (fresh.whole_wait_fixed_s, fresh.interference_s_per_mb, fresh.whole_samples) == (None, None, 0)
    assert costs.decide(HIT, 4, read_s=0.15, suffix_compute_s=0.5, predict=PREDICT).verdict is BindVerdict.WHOLE


def test_k_is_judged_against_the_prefill_model_of_the_moment():
    """The first streamed forwards come right after the server's first computed prompts: judged then, by a
    model that has seen no hit-shaped batch, they read as slow; judged again once the model knows such
    batches, the same samples give the true k."""
    costs = StreamCosts(explore_every=0)
    for mb in (100, 200):
        costs.record_stream_forward(mb * MB, SHAPE, 0.9 + 0.1e-3 * mb)  # 0.9 s of compute + 0.1 ms/MB
    early = lambda shape: 0.2  # noqa: E731 - a model fitted on other shapes underpredicts this batch
    assert costs.interference_s_per_byte(early) > 2e-3 / MB  # 0.7 s over 200 MB: "never stream"
    assert costs.interference_s_per_byte(lambda shape: 0.9) == pytest.approx(0.1e-3 / MB)
    assert costs.decide(HIT, 8, read_s=0.8, suffix_compute_s=0.8, predict=early).verdict is BindVerdict.WHOLE
    later = costs.decide(HIT, 8, read_s=0.8, suffix_compute_s=0.8, predict=lambda shape: 0.9)
    assert later.verdict is BindVerdict.STREAM


def test_the_load_back_a_whole_load_makes_counts_on_its_side():
    """k holds the tail's host -> device copy; a whole load makes the same copy before its forward (X)."""
    base = dict(hit_bytes=HIT, groups=8, read_s=0.8, suffix_compute_s=0.8, whole_wait_s=0.9,
                interference_s_per_byte=0.5 / HIT)  # gate 0.1, k x bytes 0.5: gain 0.3 >= 5% of 1.7 (0.085)
    assert decide(BindInputs(**base)).verdict is BindVerdict.STREAM
    heavy = base | {"interference_s_per_byte": 0.75 / HIT}  # gain 0.05 < 0.085: loaded whole ...
    assert decide(BindInputs(**heavy)).verdict is BindVerdict.WHOLE
    assert decide(BindInputs(**heavy, load_back_s=0.4)).verdict is BindVerdict.STREAM  # ... X: 0.45 >= 0.105
    costs = StreamCosts(explore_every=0)
    assert costs.load_back_s(HIT) is None
    for mb, s in ((50, 0.12), (100, 0.22), (200, 0.42)):  # 0.02 s + 2 ms / MB
        costs.record_load_back(mb * MB, s)
    assert costs.load_back_s(100 * MB) == pytest.approx(0.22)
    snap = costs.snapshot()
    assert snap.load_back_samples == 3 and snap.load_back_s_per_mb == pytest.approx(2e-3)
    assert snap.load_back_fixed_s == pytest.approx(0.02)


def test_forwards_no_slower_than_predicted_learn_no_interference():
    costs = StreamCosts(explore_every=0)
    for mb in (100, 200):
        costs.record_stream_forward(mb * MB, SHAPE, 0.49)  # a little faster than the model: no fit >= 0
    assert costs.interference_s_per_byte(PREDICT) == 0.0
    assert costs.snapshot(PREDICT).interference_s_per_mb == 0.0  # learned: 0, not "unknown"


def test_every_nth_decided_hit_takes_the_other_path():
    costs = StreamCosts(explore_every=4)
    for mb in (100, 200):
        costs.record_stream_forward(mb * MB, SHAPE, 0.5 + 1.6e-3 * mb)
    verdicts = [costs.decide(HIT, 4, read_s=0.15, suffix_compute_s=0.5, predict=PREDICT) for _ in range(8)]
    assert [d.verdict for d in verdicts].count(BindVerdict.STREAM) == 2  # the 4th and the 8th
    assert verdicts[3].reason == "re-measuring: streamed" and verdicts[3].gain_s is not None
    undecided = StreamCosts(explore_every=1)  # a verdict without a prediction is never flipped
    assert undecided.decide(HIT, 4, read_s=None, suffix_compute_s=0.5).verdict is BindVerdict.STREAM


def timed(costs: StreamCosts, path: BindVerdict, excess_s: float, n: int = 2, nbytes: int = HIT) -> None:
    """``n`` hits of ``path`` timed end to end: op start to first token = compute (PREDICT) + ``excess_s``."""
    for _ in range(n):
        rid = f"{path.value}-{next(RIDS)}"
        costs.begin_hit(rid, path, 100.0, nbytes)
        assert costs.timing(rid) is path
        assert costs.finish_hit(rid, 100.0 + 0.5 + excess_s, SHAPE) is path and costs.timing(rid) is None


def test_measured_excess_decides_once_both_paths_have_it():
    """bench_streaming's fast device on a 2-vCPU VM: the model said stream (W + X 0.54 s vs gate + k 0.31 s);
    timed end to end a whole load cost 0.40 s over a device hit and a streamed one 0.47 s: measured, the hit
    loads whole."""
    costs = StreamCosts(explore_every=0)
    costs.record_whole(100 * MB, 0.25)
    costs.record_whole(HIT, 0.49)
    for mb in (100, 200):
        costs.record_stream_forward(mb * MB, SHAPE, 0.5 + 0.155e-3 * mb)  # k = 0.155 ms/MB: 0.03 s per hit
    assert costs.decide(HIT, 4, read_s=0.15, suffix_compute_s=0.5, predict=PREDICT).verdict is BindVerdict.STREAM
    timed(costs, BindVerdict.WHOLE, 0.40)
    assert costs.measured_s(BindVerdict.STREAM, HIT, PREDICT) is None  # one path alone decides nothing
    timed(costs, BindVerdict.STREAM, 0.47)
    assert costs.measured_s(BindVerdict.WHOLE, HIT, PREDICT) == pytest.approx(0.40)
    decision = costs.decide(HIT, 4, read_s=0.15, suffix_compute_s=0.5, predict=PREDICT)
    assert decision.verdict is BindVerdict.WHOLE and decision.reason == "measured no faster: loaded whole"
    assert decision.gain_s == pytest.approx(-0.07)
    assert costs.decide(HIT, 4, 0.15, 0.5, predict=None).verdict is BindVerdict.STREAM  # no model: unjudged
    snap = costs.snapshot(PREDICT)
    assert (snap.measured_whole_hits, snap.measured_stream_hits) == (2, 2)
    assert snap.measured_whole_s_per_mb == pytest.approx(0.40 / 200) and snap.measured_stream_s_per_mb is not None


def test_a_measured_gain_must_be_a_share_of_the_whole_load_ttft():
    # break-even: a whole load 0.62 s over compute, a streamed hit 0.35 s: gain 0.27 s >= 5% of 1.12 s
    fast = dict(hit_bytes=HIT, groups=4, read_s=0.5, suffix_compute_s=0.5)
    assert decide(BindInputs(**fast, measured_whole_s=0.62, measured_stream_s=0.35)).verdict is BindVerdict.STREAM
    # a gain of 0.04 s is under 5% of 0.92 s: loaded whole, whatever the model says
    near = decide(BindInputs(**fast, interference_s_per_byte=0.0, measured_whole_s=0.42, measured_stream_s=0.38))
    assert near.verdict is BindVerdict.WHOLE and near.reason.startswith("measured")
    # measured figures decide even where the model has no inputs (no read model)
    assert decide(BindInputs(HIT, 4, None, None, measured_whole_s=0.6, measured_stream_s=0.1)).reason == (
        "measured faster: streamed")


def test_hit_timings_are_dropped_when_invalid_and_bounded():
    costs = StreamCosts(explore_every=0)
    costs.begin_hit("r", BindVerdict.STREAM, 10.0, HIT)
    assert costs.finish_hit("r", 11.0, None) is None and costs.timing("r") is None  # not a valid sample: gone
    assert costs.finish_hit("never-begun", 11.0, SHAPE) is None
    costs.begin_hit("late", BindVerdict.WHOLE, 10.0, HIT)
    assert costs.finish_hit("late", 9.0, SHAPE) is None  # ended before it began: no sample
    costs.begin_hit("empty", BindVerdict.WHOLE, 10.0, 0)  # no bytes: not timed
    assert costs.timing("empty") is None
    assert costs.snapshot(PREDICT).measured_whole_hits == costs.snapshot(PREDICT).measured_stream_hits == 0
    for i in range(MAX_PENDING + 5):  # requests aborted before their first token never pile up
        costs.begin_hit(f"a{i}", BindVerdict.WHOLE, 1.0, MB)
    assert costs.timing("a0") is None and costs.timing("a5") is BindVerdict.WHOLE
    assert costs.timing(f"a{MAX_PENDING + 4}") is BindVerdict.WHOLE


def test_each_path_keeps_its_last_hits():
    costs = StreamCosts(explore_every=0)
    timed(costs, BindVerdict.WHOLE, 0.9, n=HIT_WINDOW)  # a device that was slow ...
    timed(costs, BindVerdict.WHOLE, 0.3, n=HIT_WINDOW)  # ... and is fast now: only the last window counts
    assert costs.measured_s(BindVerdict.WHOLE, HIT, PREDICT) == pytest.approx(0.3)
