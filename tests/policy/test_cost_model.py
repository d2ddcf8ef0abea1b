"""The load-or-recompute cost model as pure functions, and its estimators on synthetic samples."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_kvtier.policy.cost_model import (
    CostConfig,
    DeviceModel,
    LoadProgress,
    PrefillEstimator,
    PrefillModel,
    RequestShape,
    plan,
    should_terminate,
    ttft,
    wait_time,
)

MB = 1 << 20
P, PB = 64, 4 * MB  # 64-token pages of 4 MiB (a large model's KV per page)
PREFILL = PrefillModel(per_token_s=50e-6, per_token_kctx_s=5e-6, fixed_s=0.02)  # ~20k tok/s plus attention
FAST = DeviceModel(bandwidth_Bps=20e9, batch_latency_s=0.001)  # striped NVMe
SLOW = DeviceModel(bandwidth_Bps=200e6, batch_latency_s=0.05)  # a degraded NVMe-oF path


def shape(hit=256, cached=0, tail=100, page_tokens=P, page_bytes=PB) -> RequestShape:
    return RequestShape(page_tokens, page_bytes, hit, cached_tokens=cached, tail_tokens=tail)


# ---------------------------------------------------------------------------------------------- models
def test_prefill_time_grows_with_context_and_computes_at_least_one_token():
    m = PrefillModel(1e-4, 1e-5, 0.01)
    assert m.time(1000, 8000) > m.time(1000, 0) > m.time(500, 0)
    assert m.time(0, 5000) == m.time(1, 5000)
    assert m.time(1000, 0) == pytest.approx(1e-4 * 1000 + 1e-5 * 1000 * 500 / 1000 + 0.01)
    assert PrefillModel.from_tokens_per_s(10_000).time(10_000, 0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        PrefillModel.from_tokens_per_s(0)
    with pytest.raises(ValueError):
        CostConfig(batch_pages=0)


# ---------------------------------------------------------------------------------------------- plan
def test_fast_device_loads_everything():
    d = plan(shape(hit=256), FAST, PREFILL)
    assert (d.load_pages, d.recompute_pages, d.terminate) == (256, 0, False)
    assert d.ttft_s < d.recompute_now_s


def test_slow_device_recomputes_everything():
    d = plan(shape(hit=256), SLOW, PREFILL)
    assert (d.load_pages, d.recompute_pages, d.terminate) == (0, 256, True)
    assert d.ttft_s == d.recompute_now_s


def test_partial_load_stops_before_a_batch_that_costs_more_than_it_saves():
    device = DeviceModel(bandwidth_Bps=20e9, batch_latency_s=0.5)  # fast bytes, a costly extra batch
    d = plan(shape(hit=129, tail=10), device, PREFILL)
    assert d.load_pages == 128 and d.recompute_pages == 1
    assert d.ttft_s < ttft(shape(hit=129, tail=10), LoadProgress(), device, PREFILL, 129)


def test_pages_already_loaded_are_free():
    s = shape(hit=256, tail=10)
    device = DeviceModel(bandwidth_Bps=0.7e9, batch_latency_s=0.01)  # from scratch: not worth it
    assert plan(s, device, PREFILL).load_pages == 0
    on_time = device.load_time(128, PB)
    d = plan(s, device, PREFILL, LoadProgress(loaded_pages=128, elapsed_s=on_time))
    assert d.load_pages == 256  # the second half alone pays: its attention work is the costliest


def test_a_long_io_queue_ahead_turns_a_load_into_a_recompute():
    s = shape(hit=128)
    device = DeviceModel(bandwidth_Bps=4e9, batch_latency_s=0.002)
    assert plan(s, device, PREFILL).load_pages == 128
    assert plan(s, device, PREFILL, LoadProgress(queued_pages=4096)).load_pages == 0


def test_margin_refuses_a_load_that_wins_by_too_little():
    s = shape(hit=256)
    d = plan(s, FAST, PREFILL)
    gain = d.recompute_now_s - d.ttft_s
    assert plan(s, FAST, PREFILL, cfg=CostConfig(margin_s=gain * 0.9)).load_pages == 256
    assert plan(s, FAST, PREFILL, cfg=CostConfig(margin_s=gain * 1.1)).load_pages == 0


def test_monotonic_in_bandwidth_and_prefill_speed():
    s = shape(hit=300, cached=2000, tail=50)
    previous = -1
    for bw in [10 ** (6 + i / 4) for i in range(20)]:  # 1 MB/s .. 56 GB/s
        k = plan(s, DeviceModel(bw, 0.01), PREFILL).load_pages
        assert k >= previous
        previous = k
    assert previous == 300
    previous = 10 ** 9
    for scale in [10 ** (3 - i / 4) for i in range(24)]:  # prefill from 1000x slower to ~300x faster
        k = plan(s, DeviceModel(1e9, 0.01), PrefillModel(50e-6 * scale, 5e-6 * scale, 0.02 * scale)).load_pages
        assert k <= previous
        previous = k
    assert previous == 0


# ---------------------------------------------------------------------------------------------- stop decision
def test_a_load_on_schedule_is_not_cut_and_a_landed_one_never():
    s = shape(hit=512)
    on_time = FAST.load_time(256, PB)
    assert not should_terminate(s, LoadProgress(loaded_pages=256, elapsed_s=on_time), FAST, PREFILL).terminate
    done = should_terminate(s, LoadProgress(loaded_pages=512, elapsed_s=100.0), FAST, PREFILL)
    assert (done.terminate, done.load_pages) == (False, 512)


def test_a_stalled_load_is_cut_and_stays_cut():
    s = shape(hit=512)
    progress = [should_terminate(s, LoadProgress(loaded_pages=128, elapsed_s=e / 10), FAST, PREFILL).terminate
                for e in range(400)]
    assert progress[0] is False
    first = progress.index(True)
    assert all(progress[first:])
    # the cut comes once the lateness exceeds what the rest of the load would save
    d = should_terminate(s, LoadProgress(loaded_pages=128, elapsed_s=first / 10), FAST, PREFILL)
    assert d.recompute_now_s <= d.ttft_s + 1e-12


def test_a_slow_device_is_cut_at_once():
    d = should_terminate(shape(hit=256), LoadProgress(), SLOW, PREFILL)
    assert d.terminate and d.load_pages == 0


def test_wait_time_of_a_late_load_grows_with_its_lateness():
    s = shape(hit=256)
    on_time = FAST.load_time(128, PB)
    w = [wait_time(s, LoadProgress(loaded_pages=0, elapsed_s=on_time + x), FAST, 256) for x in (0.0, 1.0, 2.0)]
    assert w[0] == pytest.approx(FAST.load_time(256, PB) - on_time)
    assert w[1] < w[2] and w[2] - w[1] == pytest.approx(1.0)
    assert wait_time(s, LoadProgress(loaded_pages=128), FAST, 100) == 0


shapes = st.builds(RequestShape, page_tokens=st.sampled_from([1, 16, 64]), page_bytes=st.integers(4096, 8 * MB),
                   hit_pages=st.integers(0, 700), cached_tokens=st.integers(0, 50_000), tail_tokens=st.integers(0, 5000))
devices = st.builds(DeviceModel, bandwidth_Bps=st.floats(1e5, 1e11), batch_latency_s=st.floats(0, 1))
prefills = st.builds(PrefillModel, st.floats(1e-7, 1e-2), st.floats(0, 1e-3), st.floats(0, 1))
cfgs = st.builds(CostConfig, batch_pages=st.sampled_from([1, 7, 128]), margin_s=st.floats(0, 0.5))


@settings(max_examples=300, deadline=None)
@given(shapes, devices, prefills, cfgs, st.integers(0, 700), st.floats(0, 30))
def test_never_waits_for_a_load_predicted_slower_than_recomputing(s, dev, pre, cfg, loaded, elapsed):
    progress = LoadProgress(loaded_pages=min(loaded, s.hit_pages), elapsed_s=elapsed)
    lo, now = progress.loaded_pages, ttft(s, progress, dev, pre, progress.loaded_pages, cfg)
    for fn, ks in ((plan, range(lo, s.hit_pages + 1)),
                   (should_terminate, [k for k in range(lo, s.hit_pages + 1) if k % cfg.batch_pages == 0
                                       or k == s.hit_pages])):
        d = fn(s, dev, pre, progress, cfg) if fn is plan else fn(s, progress, dev, pre, cfg)
        best = min(ttft(s, progress, dev, pre, k, cfg) for k in [lo, *ks])
        assert d.recompute_now_s == pytest.approx(now)
        assert d.load_pages + d.recompute_pages == s.hit_pages and d.load_pages >= lo
        if d.load_pages > lo:  # waiting is chosen only when it wins by more than the margin...
            assert d.ttft_s + cfg.margin_s < now
            assert d.ttft_s == pytest.approx(best, rel=1e-9, abs=1e-12)  # ...and then the best k
        else:  # ...otherwise nothing on offer beats recomputing now by more than the margin
            assert best + cfg.margin_s >= now * (1 - 1e-9) - 1e-12
        assert d.terminate == (d.load_pages == lo < s.hit_pages)


# ---------------------------------------------------------------------------------------------- estimators
def test_prefill_estimator_recovers_an_attention_aware_model():
    rng = random.Random(11)
    truth = PrefillModel(40e-6, 8e-6, 0.015)
    est = PrefillEstimator(half_life=200, min_samples=4)
    assert est.model() is None
    for _ in range(300):
        reqs = [(rng.randint(16, 4096), rng.randint(0, 30_000)) for _ in range(rng.randint(1, 4))]
        seconds = sum(truth.time(t, c) - truth.fixed_s for t, c in reqs) + truth.fixed_s
        est.record_batch(reqs, seconds * rng.uniform(0.98, 1.02))
    m = est.model()
    assert m.per_token_s == pytest.approx(40e-6, rel=0.1)
    assert m.per_token_kctx_s == pytest.approx(8e-6, rel=0.05)
    assert m.fixed_s == pytest.approx(0.015, abs=0.01)
    for t, c in [(512, 0), (4096, 16_000), (100, 60_000)]:
        assert m.time(t, c) == pytest.approx(truth.time(t, c), rel=0.05)
    assert est.snapshot()["source"] == "fit"


def test_prefill_estimator_seed_until_enough_samples_and_never_negative():
    seed = PrefillModel.from_tokens_per_s(10_000)
    est = PrefillEstimator(min_samples=4, seed=seed)
    for tokens in (1000, 2000, 3000):
        est.record(tokens, 0, 0.5)  # flat: bigger prefills no slower (a clock-bound regime)
    assert est.model() is seed and est.snapshot()["source"] == "seed"
    est.record(4000, 0, 0.5)
    est.record(0, 0, 9.9)  # ignored: no new tokens
    m = est.model()
    assert m is not seed and est.samples == 4
    assert min(m.per_token_s, m.per_token_kctx_s, m.fixed_s) >= 0
    assert m.time(2500, 0) == pytest.approx(0.5, rel=1e-6)


def test_a_batch_pays_the_fixed_cost_once():
    model = PrefillModel(1e-3, 2e-3, 0.05)
    reqs = [(64, 1536), (32, 0), (0, 99)]  # a request with no new tokens adds nothing
    assert model.batch_time(reqs) == pytest.approx(model.time(64, 1536) + model.time(32, 0) - 0.05)
    assert model.batch_time([]) == pytest.approx(0.05)
