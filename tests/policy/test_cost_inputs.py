"""The cost policy of one backend: its switch, its prefill sampler, and the hit it reports (no SGLang)."""

from __future__ import annotations

import logging

import pytest

from sgl_kvtier.policy.cost_inputs import (
    ENV_POLICY,
    ENV_PREFILL_TOKENS_PER_S,
    LOG_INTERVAL_S,
    CostPolicy,
    PolicyMode,
    PrefillSampler,
    ReadPath,
    prefill_seed,
)
from sgl_kvtier.policy.cost_model import DeviceModel, PrefillModel, RequestShape, plan
from sgl_kvtier.telemetry.counters import BoundaryCounts, ErrorBoundary
from sgl_kvtier.telemetry.snapshot import PrefillSnapshot, PrefillSource

PAGE_TOKENS, PAGE_BYTES = 16, 16384
SLOW_DEVICE = ReadPath(PAGE_TOKENS, PAGE_BYTES, DeviceModel(1e6, 0.5))  # 40 pages: ~1.2 s
FAST_DEVICE = ReadPath(PAGE_TOKENS, PAGE_BYTES, DeviceModel(2e9, 1e-3))  # 40 pages: ~1.3 ms
FAST_PREFILL = PrefillModel(1e-7, 0.0, 1e-4)
SLOW_PREFILL = PrefillModel(1e-3, 1e-4, 0.05)


def test_the_switch_reads_the_environment_and_warns_once_per_bad_value(caplog):
    assert PolicyMode.from_environ({}) is PolicyMode.OFF
    assert PolicyMode.from_environ({ENV_POLICY: " Cost "}) is PolicyMode.COST
    assert PolicyMode.from_environ({ENV_POLICY: "off"}) is PolicyMode.OFF
    with caplog.at_level(logging.WARNING, logger="sgl_kvtier.policy.cost_inputs"):
        for _ in range(3):
            assert PolicyMode.from_environ({ENV_POLICY: "timeout-ish"}) is PolicyMode.OFF
    assert sum("timeout-ish" in r.getMessage() for r in caplog.records) == 1


def test_the_prefill_seed_comes_from_the_environment():
    assert prefill_seed({}) is None
    assert prefill_seed({ENV_PREFILL_TOKENS_PER_S: "2000"}) == PrefillModel(1 / 2000, 0.0, 0.0)
    assert prefill_seed({ENV_PREFILL_TOKENS_PER_S: "-5"}) is None
    assert prefill_seed({ENV_PREFILL_TOKENS_PER_S: "fast"}) is None


def test_the_sampler_skips_warm_up_and_malformed_batches():
    sampler = PrefillSampler(seed=SLOW_PREFILL, warmup_batches=2)
    assert sampler.snapshot() == PrefillSnapshot(1e-3, 1e-4, 0.05, samples=0, source=PrefillSource.SEED)
    assert [sampler.record_batch([100], [0], 0.1) for _ in range(2)] == [False, False]  # warm-up
    assert sampler.record_batch([100, 5], [0], 0.1) is False  # lengths disagree
    assert sampler.record_batch([], [], 0.1) is False
    for i in range(1, 6):
        assert sampler.record_batch([100 * i], [0], 0.1 * i) is True
    snap = sampler.snapshot()
    assert snap.samples == 5 and snap.source is PrefillSource.FIT
    assert sampler.model().time(1000, 0) == pytest.approx(1.0, rel=1e-6)  # 0.1 s per 100 tokens


def policy(read: ReadPath | None, prefill: PrefillModel | None, mode: PolicyMode = PolicyMode.COST,
           boundary: ErrorBoundary | None = None) -> CostPolicy:
    return CostPolicy(lambda: read, PrefillSampler(seed=prefill), boundary, mode=lambda: mode)


def test_the_hit_is_shortened_only_when_on_measured_and_slower_than_recomputing():
    assert policy(SLOW_DEVICE, FAST_PREFILL, PolicyMode.OFF).shorten_hit(41, 40, 0) == 40
    assert policy(None, FAST_PREFILL).shorten_hit(41, 40, 0) == 40  # read path not measured
    assert policy(SLOW_DEVICE, None).shorten_hit(41, 40, 0) == 40  # prefill speed not measured
    assert policy(SLOW_DEVICE, FAST_PREFILL).shorten_hit(41, 0, 0) == 0
    on = policy(SLOW_DEVICE, FAST_PREFILL)
    shape = RequestShape(PAGE_TOKENS, PAGE_BYTES, 40, cached_tokens=3 * PAGE_TOKENS, tail_tokens=PAGE_TOKENS)
    assert on.shorten_hit(41, 40, 3) == plan(shape, SLOW_DEVICE.device, FAST_PREFILL).load_pages == 0
    assert policy(FAST_DEVICE, FAST_PREFILL).shorten_hit(41, 40, 3) == 0  # a fast device, recomputing faster still
    assert policy(FAST_DEVICE, SLOW_PREFILL).shorten_hit(41, 40, 3) == 40  # loading pays
    assert on.inputs() is not None and on.inputs().read == SLOW_DEVICE and on.inputs().prefill == FAST_PREFILL


def test_a_failing_input_keeps_the_hit_and_is_counted():
    boundary = ErrorBoundary(logging.getLogger("test.kvtier"))

    def broken() -> ReadPath:
        raise ZeroDivisionError("injected")

    p = CostPolicy(broken, PrefillSampler(seed=FAST_PREFILL), boundary, mode=lambda: PolicyMode.COST)
    assert p.shorten_hit(41, 40, 0) == 40
    assert boundary.counts() == BoundaryCounts(expected=0, unexpected=1)


def test_the_inputs_log_line_is_due_once_per_interval():
    p = policy(SLOW_DEVICE, FAST_PREFILL)
    assert p.log_due(100.0) is True
    assert p.log_due(100.0 + LOG_INTERVAL_S / 2) is False
    assert p.log_due(100.0 + LOG_INTERVAL_S) is True
