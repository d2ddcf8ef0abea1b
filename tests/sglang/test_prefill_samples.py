"""The shared prefill samples (``sgl_kvtier.sglang.prefill_samples``): one sample per extend batch into the backend
behind the scheduler's tree; every batch observer sees each extend batch (with or without a backend) and any of
them can take it out; a failing observer or sampler is counted, never raised into the scheduler. Real
``ScheduleBatch``\\ es, a stand-in backend (``backend_of`` replaced)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sgl_kvtier.sglang import prefill_samples  # noqa: E402
from sgl_kvtier.telemetry.counters import BoundaryCounts, ErrorBoundary  # noqa: E402

T0 = 1000.0


class Sampler:
    def __init__(self) -> None:
        self.batches: list[tuple[list[int], list[int], float]] = []

    def record_batch(self, extend, prefix, seconds) -> bool:
        self.batches.append((extend, prefix, seconds))
        return True


@pytest.fixture
def backend(monkeypatch):
    """A stand-in for our backend behind every tree but ``None``; no observer, the clock at ``T0``."""
    fake = SimpleNamespace(cost=SimpleNamespace(prefill=Sampler()), boundary=ErrorBoundary(logging.getLogger(__name__)))
    monkeypatch.setattr(prefill_samples, "backend_of", lambda cache: None if cache is None else fake)
    monkeypatch.setattr(prefill_samples, "OBSERVERS", [])
    monkeypatch.setattr(prefill_samples, "_clock", lambda: T0)
    return fake


def batch(mode: str, extend: int, seconds: float) -> ScheduleBatch:
    return ScheduleBatch(reqs=[], forward_mode=ForwardMode[mode], extend_lens=[extend], prefix_lens=[16],
                         launch_ts=T0 - seconds)


def test_one_sample_per_extend_batch_unless_an_observer_takes_it_out(backend) -> None:
    seen: list[tuple[int, bool]] = []

    def keeps_small(scheduler, b, found, now) -> bool:
        seen.append((b.extend_lens[0], found is backend))
        return b.extend_lens[0] < 100

    def counts(scheduler, b, found, now) -> bool:
        seen.append((-b.extend_lens[0], now == T0))
        return True

    prefill_samples.observe(keeps_small)
    prefill_samples.observe(keeps_small)  # once
    prefill_samples.observe(counts)
    scheduler = SimpleNamespace(tree_cache=object())
    for b in (batch("EXTEND", 64, 0.5), batch("MIXED", 200, 1.0), batch("DECODE", 1, 0.1)):
        prefill_samples.record(scheduler, b)
    prefill_samples.record(scheduler, object())  # not a batch: nobody sees it
    prefill_samples.record(SimpleNamespace(tree_cache=None), batch("EXTEND", 32, 0.1))  # no backend: seen, no sample
    assert seen == [(64, True), (-64, True), (200, True), (-200, True), (32, False), (-32, True)]
    assert backend.cost.prefill.batches == [([64], [16], 0.5)]  # the declined batch is no sample
    assert backend.boundary.counts() == BoundaryCounts()


def test_a_failing_observer_or_sampler_is_counted_and_the_sample_skipped(backend) -> None:
    def broken(*args) -> bool:
        raise TypeError("injected observer bug")

    prefill_samples.observe(broken)
    scheduler = SimpleNamespace(tree_cache=object())
    prefill_samples.record(scheduler, batch("EXTEND", 64, 0.5))  # never raised
    assert backend.cost.prefill.batches == [] and backend.boundary.counts().unexpected == 1
    prefill_samples.OBSERVERS.clear()
    backend.cost.prefill.record_batch = broken
    prefill_samples.record(scheduler, batch("EXTEND", 64, 0.5))
    assert backend.boundary.counts().unexpected == 2


def test_a_plugin_that_samples_every_batch_says_so(monkeypatch) -> None:
    monkeypatch.setattr(prefill_samples, "_every_batch", False)
    assert not prefill_samples.every_batch_sampled()
    prefill_samples.sample_every_batch()
    assert prefill_samples.every_batch_sampled()
