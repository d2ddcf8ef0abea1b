"""SGLang's storage-prefetch counters for streamed tails (``plugins.stream_accounting``).

1. The rule, on SGLang's real ``StorageMetricsCollector`` (its series in a private registry): what is held,
   released, settled once, and that nothing is held with metrics off or for another request.
2. Through SGLang 0.5.23's real ``UnifiedRadixCache`` + ``HybridCacheController`` and our backend with the
   streaming test double (``stream_kit``): a tail that streams is not counted unfulfilled at its prefetch
   result, only once it is dropped; a hit part that does not stream is counted at once, as SGLang does.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from hook_kit import install_hooks  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from stream_kit import PS, consumer_over_stored_prompt, new_req, reap_all, registered  # noqa: E402
from test_controller import _PrivateRegistryCollector  # noqa: E402

from sgl_kvtier.experiments.streaming.backend_side import require_side
from sgl_kvtier.experiments.streaming.hooks import accounting as stream_accounting  # noqa: E402
from sgl_kvtier.experiments.streaming.hooks import admit as stream_admit
from sgl_kvtier.experiments.streaming.hooks import core as stream_core
from sgl_kvtier.experiments.streaming.hooks import slots as stream_slots

pytestmark = pytest.mark.timeout(300)
LABELS = {"storage_backend": "dynamic", "tp_rank": "0"}
UNFULFILLED = "sglang:storage_prefetch_unfulfilled_tokens_total"
PREFETCHED = "sglang:prefetched_tokens_total"


class Metrics:
    """SGLang's real storage collector in a registry of its own, and its samples."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.collector = _PrivateRegistryCollector(self.registry, LABELS)

    def unfulfilled(self, reason: str = "storage_transfer") -> float:
        return self.registry.get_sample_value(UNFULFILLED, {**LABELS, "reason": reason}) or 0

    def prefetched(self) -> float:
        return self.registry.get_sample_value(PREFETCHED, LABELS) or 0

    def attach(self, cache) -> None:
        cache.enable_storage_metrics = True  # --enable-metrics: SGLang sets its collector the same way
        cache.storage_metrics_collector = self.collector


class Tail:
    """A stand-in for a ``StreamedTail`` (only its identity is used)."""


def fake_cache(metrics: Metrics | None, remaining: dict) -> SimpleNamespace:
    cache = SimpleNamespace(enable_storage_metrics=metrics is not None, _storage_prefetch_hit_remaining_by_reqid=remaining)
    cache.storage_metrics_collector = None if metrics is None else metrics.collector
    return cache


def sglang_resolve(calls: list):
    """SGLang's resolution as far as the counter goes: the request's remaining count falls, a reason is logged."""
    def original(cache, request, num_tokens, reason=None):
        calls.append((request, num_tokens, reason))
        remaining = cache._storage_prefetch_hit_remaining_by_reqid
        dropped = min(num_tokens, remaining[request])
        remaining[request] -= dropped
        if reason is not None and cache.storage_metrics_collector is not None:
            cache.storage_metrics_collector.log_storage_prefetch_unfulfilled_tokens(dropped, reason)
    return original


# ---------------------------------------------------------------------------------------------- 1. the rule
def test_inside_holding_the_requests_resolution_is_held_and_sglangs_count_still_falls() -> None:
    metrics, calls = Metrics(), []
    req, other = object(), object()
    cache = fake_cache(metrics, {req: 100, other: 50})
    resolve = sglang_resolve(calls)
    with stream_accounting.holding(cache, req) as held:
        stream_accounting.resolve_quietly(resolve, cache, req, 120, reason="storage_transfer")  # capped at 100
        stream_accounting.resolve_quietly(resolve, cache, other, 10, reason="deadline")  # another request: logged
        stream_accounting.resolve_quietly(resolve, cache, req, 0)  # no reason: nothing to hold
    assert held == [(100, "storage_transfer")]
    assert calls == [(req, 120, None), (other, 10, "deadline"), (req, 0, None)]
    assert cache._storage_prefetch_hit_remaining_by_reqid == {req: 0, other: 40}
    assert metrics.unfulfilled() == 0 and metrics.unfulfilled("deadline") == 10
    stream_accounting.resolve_quietly(resolve, cache, other, 5, reason="deadline")  # outside holding: unchanged
    assert metrics.unfulfilled("deadline") == 15


def test_metrics_off_or_an_unknown_table_holds_nothing() -> None:
    calls: list = []
    req = object()
    off = fake_cache(None, {req: 100})
    with stream_accounting.holding(off, req) as held:
        stream_accounting.resolve_quietly(sglang_resolve(calls), off, req, 30, reason="storage_transfer")
    assert held == [] and calls == [(req, 30, "storage_transfer")]
    metrics = Metrics()
    other_sglang = SimpleNamespace(enable_storage_metrics=True, storage_metrics_collector=metrics.collector)
    seen: list = []
    with stream_accounting.holding(other_sglang, req) as held:
        stream_accounting.resolve_quietly(lambda *a, **k: seen.append((a, k)), other_sglang, req, 30,
                                          reason="storage_transfer")
    assert held == [] and seen == [((other_sglang, req, 30), {"reason": "storage_transfer"})]  # its own log stands
    odd = fake_cache(metrics, {req: "many"})  # not SGLang's numbers: never raises into its thread, its log stands
    with stream_accounting.holding(odd, req) as held:
        stream_accounting.resolve_quietly(lambda *a, **k: seen.append((a, k)), odd, req, 30, reason="deadline")
    assert held == [] and seen[-1] == ((odd, req, 30), {"reason": "deadline"})


def test_a_held_tail_settles_once_kept_as_prefetched_or_dropped_as_unfulfilled() -> None:
    metrics = Metrics()
    cache = fake_cache(metrics, {})
    kept, dropped = Tail(), Tail()
    stream_accounting.hold(kept, [(64, "storage_transfer")])
    stream_accounting.hold(dropped, [(32, "storage_transfer"), (16, "deadline")])
    stream_accounting.settle(cache, kept, kept=True)
    stream_accounting.settle(cache, dropped, kept=False)
    assert metrics.prefetched() == 64 and metrics.unfulfilled() == 32 and metrics.unfulfilled("deadline") == 16
    stream_accounting.settle(cache, kept, kept=False)  # settled already: nothing more
    stream_accounting.settle(cache, dropped, kept=False)
    stream_accounting.settle(cache, Tail(), kept=False)  # never held
    assert metrics.prefetched() == 64 and metrics.unfulfilled() == 32 and metrics.unfulfilled("deadline") == 16
    stream_accounting.release(cache, [(8, "storage_transfer")])  # not streamed: logged at once
    assert metrics.unfulfilled() == 40


# ---------------------------------------------------------------------------------------------- 2. real cache
@pytest.fixture
def consumer(tmp_path, kit_on_cpu, cpu_shims, monkeypatch):
    install_hooks(monkeypatch, [*stream_admit.HOOKS, *stream_slots.HOOKS, *stream_accounting.HOOKS])
    with consumer_over_stored_prompt(kit_on_cpu, tmp_path, monkeypatch) as env:
        yield env


def test_a_streamed_tail_counts_unfulfilled_only_once_dropped_and_a_part_not_streamed_at_once(consumer, monkeypatch):
    env, metrics = consumer, Metrics()
    metrics.attach(env.cache)
    req = new_req("r-streams")
    registry = registered(env, req, head=2)
    tail = registry.get(req.rid)
    assert tail is not None and tail.tokens > 0
    assert metrics.unfulfilled() == 0  # SGLang's prefetch result came and went: the tail is held, streaming
    stream_core.drop(env.cache, registry, tail, "test")
    assert metrics.unfulfilled() == tail.tokens  # given up: its request computes those tokens
    tail.stream.finish()
    reap_all(env, registry)

    # another rank could not stream it (the registration vote fails): this rank's bound stream is given up
    monkeypatch.setattr(stream_admit, "min_reduce", lambda cache, flags: [0 for _ in flags])
    req2 = new_req("r-not-streamed")
    registered(env, req2, head=2)
    assert registry.get(req2.rid) is None and stream_admit.STATS.not_registered["another rank"] >= 1
    given_up = require_side(env.backend).binder.streams[-1]  # its op's part not landed: past the head it answered True for
    assert metrics.unfulfilled() == tail.tokens + (given_up.pages - given_up.head) * PS  # counted at its result
    given_up.finish()
    reap_all(env, registry)
