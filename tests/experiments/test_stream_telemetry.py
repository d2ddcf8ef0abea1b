"""Streamed tails for the operator: their figures in ``KVTierStorage.telemetry()`` and as
``kvtier_stream_*`` gauges, and the prefill samples that feed the T_hide gate's model.

- The backend's reads: a real backend with ``streaming = "on"`` on SGLang's real host pool and a real store
  (``test_tail_stream.streamed``): a clean stream answered to SGLang, one with a corrupt part, one whose
  slots are released while it reads; ``telemetry().stream`` is the binder's counters, the gauges show them.
- The plugin's counters: SGLang's real ``UnifiedRadixCache`` + ``HybridCacheController`` under the admission
  hooks (``stream_kit``, as ``test_stream_admit``): a gate that waits, a tail let through, one dropped; the
  figures arrive through the backend's ``telemetry()`` (``stream_core`` attaches its reader) and the gauges.
- Prefill samples (``stream_sample``): real ``ScheduleBatch``\\ es through the sampling hook over a real cache
  and backend (a ``Scheduler`` built without start-up, as ``test_prefetch_plugin``): sampled when streaming
  is on and the cost plugin is not loaded, never twice when it is, never a batch whose forward waited on a
  tail; once measured, the gate admits by the model, not by its "group 0 landed" fallback.

No sleeps: streams are held and released by their observer (``Hold``), the controller's queues wake the
admission tests; timeouts only bound failures. Every gauge is read from a private registry.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

if torch.cuda.is_available():  # pragma: no cover - CPU pools and the CPU shims
    pytest.skip("CPU harness", allow_module_level=True)

from hook_kit import install_hooks  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from stream_kit import (  # noqa: E402
    PS,
    close_all,
    consumer_over_stored_prompt,
    hicache,
    new_req,
    reap_all,
    registered,
)
from test_storage_adapter import slots  # noqa: E402
from test_tail_stream import BOUND_S, DST, Hold, N, flip, group_slice, streamed  # noqa: E402

from sgl_kvtier.experiments.cost_policy import plugin as prefetch  # noqa: E402
from sgl_kvtier.experiments.streaming.backend_side import require_side
from sgl_kvtier.experiments.streaming.contract import TailState  # noqa: E402
from sgl_kvtier.experiments.streaming.hooks import admit as stream_admit
from sgl_kvtier.experiments.streaming.hooks import batch_marks as batch_marks  # noqa: E402
from sgl_kvtier.experiments.streaming.hooks import copy as stream_copy
from sgl_kvtier.experiments.streaming.hooks import core as stream_core
from sgl_kvtier.experiments.streaming.hooks import retract as stream_retract
from sgl_kvtier.experiments.streaming.hooks import sample as stream_sample
from sgl_kvtier.experiments.streaming.hooks import slots as stream_slots
from sgl_kvtier.keys import parse_keys  # noqa: E402
from sgl_kvtier.policy import cost_inputs  # noqa: E402
from sgl_kvtier.sglang import prefill_samples  # noqa: E402
from sgl_kvtier.telemetry import prometheus  # noqa: E402
from sgl_kvtier.telemetry.snapshot import StreamBindSnapshot, StreamHookSnapshot, StreamSnapshot  # noqa: E402

pytestmark = pytest.mark.timeout(300)
RANKS = {"tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}
T0 = 1000.0


def gauges(backend):
    """The backend's telemetry through an ``Exporter`` over a private registry: its sample reader."""
    registry = CollectorRegistry()
    prometheus.Exporter(registry).update(backend.telemetry())
    return registry.get_sample_value


# ---------------------------------------------------------------------------------------------- the backend's reads
def test_the_backends_tail_reads_are_in_its_telemetry_and_gauges(tmp_path) -> None:
    backend, pool, keys, _ = streamed(tmp_path)
    try:
        # Streaming on, nothing bound yet, no plugin; the bind rule has learned nothing.
        assert backend.telemetry().stream == StreamSnapshot(bind=StreamBindSnapshot())
        value = gauges(backend)
        assert value("kvtier_streaming_enabled", RANKS) == 1 and value("kvtier_stream_bound_hits", RANKS) == 0
        assert value("kvtier_stream_tails", RANKS) is None  # the plugin never decided on here: not measured

        clean = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert clean.wait_ended(BOUND_S)
        assert backend.batch_get_v1(keys, slots(DST)) == [True] * N  # all of it answered to SGLang: the head
        flip(backend, keys[3], group_slice(backend.kv.pages.plan, 0, 0).start + 5)  # page 3 fails group 0
        corrupt = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert corrupt.wait_ended(BOUND_S)
        hold = Hold(group=0)
        require_side(backend).binder.observer = hold
        released = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert hold.reached.wait(BOUND_S)
        _, withheld = require_side(backend).binder.claim_released(slots(DST))  # SGLang releases the slots mid-read
        hold.release()
        assert released.wait_ended(BOUND_S)

        counts, snap = require_side(backend).binder.counts(), backend.telemetry().stream
        assert snap is not None and snap.hooks is None
        assert (snap.bound_hits, snap.head_pages, snap.failed_pages, snap.cancelled) == (3, N, 1, 1)
        assert snap.failed_groups >= 1  # group 0 of page 3, and the later ones of a page dropped as corrupt
        assert snap.streamed_pages == counts.streamed_pages >= 2 * N - 1  # the clean one whole, the corrupt one but 1
        assert snap.withheld_pages == sum(len(s) for _, s in withheld) // PS == counts.withheld_pages > 0
        assert snap == StreamSnapshot(  # every field is the binder's
            bound_hits=counts.streams_bound, read_groups=counts.read_groups, head_pages=counts.head_pages,
            streamed_pages=counts.streamed_pages,
            staged_pages=counts.staged_pages, failed_pages=counts.failed_pages, failed_groups=counts.failed_groups,
            cancelled=counts.cancelled_streams, read_errors=counts.stream_errors, withheld_pages=counts.withheld_pages,
            mismatches=counts.mismatches, bind=require_side(backend).stream_costs.snapshot())
        value = gauges(backend)
        assert {f: value(f"kvtier_stream_{f}", RANKS) for f in prometheus.STREAM_READS} == {
            f: getattr(snap, f) for f in prometheus.STREAM_READS}
    finally:
        backend.close()


def test_a_backend_that_does_not_stream_has_no_stream_series(tmp_path) -> None:
    backend, *_ = streamed(tmp_path, streaming="off")
    try:
        assert backend.telemetry().stream is None
        value = gauges(backend)
        assert value("kvtier_streaming_enabled", RANKS) == 0 and value("kvtier_stream_bound_hits", RANKS) is None
    finally:
        backend.close()


def test_the_stream_counters_are_the_binders_and_the_plugins_fields():
    from sgl_kvtier.experiments.streaming.binding import StreamCounters

    binder = {f.name for f in dataclasses.fields(StreamCounters)}
    renamed = {"streams_bound": "bound_hits", "cancelled_streams": "cancelled", "stream_errors": "read_errors"}
    assert {renamed.get(f, f) for f in binder} == set(prometheus.STREAM_READS)  # each binder counter exported


def test_the_plugins_counters_map_to_their_snapshot(monkeypatch) -> None:
    """Distinct values in each of the plugin's counters (admission, loader, retract): each lands in its field."""
    monkeypatch.setattr(stream_core, "STATS", stream_core.AdmitStats(
        bind_calls=1, registered=2, ready=3, admitted=4, gate_waits=5, gate_wait_s=6.5, withheld_registered=7,
        not_registered=Counter({"withheld cap": 8}), dropped=Counter({"gate": 9, "abort": 10})))
    monkeypatch.setattr(stream_copy, "STATS", stream_copy.StreamLoadStats(
        loads=11, tails=12, layers_copied=13, layers_zeroed=14, failed_groups=15, timeouts=16, injected=17, landed=18,
        poisoned=19, blocked_waits=20, blocked_s=21.5))
    monkeypatch.setattr(stream_retract, "STATS", stream_retract.RetractStats(retracted=22, requeued=23, aborted=24))
    assert stream_core.hook_snapshot() == StreamHookSnapshot(
        bind_calls=1, tails=2, ready=3, admitted=4, gate_waits=5, gate_wait_s=6.5, withheld_registered_slots=7,
        not_streamed={"withheld cap": 8}, dropped={"gate": 9, "abort": 10}, loads=11, loaded_tails=12,
        copied_layers=13, zeroed_layers=14, zero_filled_groups=15, timeouts=16, landed=18, poisoned=19, stalls=20,
        stall_s=21.5, retracts=22, requeued=23, aborted=24)


# ---------------------------------------------------------------------------------------------- the plugin's counters
@pytest.fixture
def hooks(monkeypatch, cpu_shims):
    """The admission and host-slot hooks applied to SGLang's classes; registry and classes restored after."""
    install_hooks(monkeypatch, [*stream_admit.HOOKS, *stream_slots.HOOKS])


@pytest.fixture
def consumer(tmp_path, kit_on_cpu, hooks, monkeypatch):
    """A cache with the streaming test backend (``stream_kit``) over a store holding the prompt."""
    with consumer_over_stored_prompt(kit_on_cpu, tmp_path, monkeypatch) as env:
        yield env


def test_the_plugins_counters_reach_the_backends_telemetry(consumer) -> None:
    env = consumer
    assert stream_core.active(env.cache) is not None  # decided on: the backend now reports the plugin's figures
    before = env.backend.telemetry().stream.hooks
    assert before is not None
    req, other = new_req("r-metrics"), new_req("r-metrics-drop")
    registry = registered(env, other, head=2)  # one streamed hit at a time (the alone rule): this one first
    dropped = registry.get(other.rid)
    dropped.stream.fail(0)
    assert env.cache.check_prefetch_progress(other.cache_request_handle) is True
    assert dropped.state is TailState.DROPPED
    dropped.stream.finish()
    reap_all(env, registry)
    tail = registered(env, req, head=2).get(req.rid)
    assert env.cache.check_prefetch_progress(req.cache_request_handle) is False  # group 0 not landed: wait
    tail.stream.land(0)
    assert env.cache.check_prefetch_progress(req.cache_request_handle) is True and tail.state is TailState.READY

    after = env.backend.telemetry().stream.hooks
    assert (after.tails - before.tails, after.ready - before.ready, after.gate_waits - before.gate_waits) == (2, 1, 1)
    assert after.dropped["gate"] - before.dropped.get("gate", 0) == 1 and after.gate_wait_s >= before.gate_wait_s
    value = gauges(env.backend)
    assert value("kvtier_stream_tails", RANKS) == after.tails and value("kvtier_stream_gate_waits", RANKS) == after.gate_waits
    assert value("kvtier_stream_dropped", {**RANKS, "reason": "gate"}) == after.dropped["gate"]
    assert value("kvtier_stream_gate_wait_seconds", RANKS) == after.gate_wait_s
    tail.stream.finish()  # the READY tail's slots go at the detach


# ---------------------------------------------------------------------------------------------- prefill samples
def scheduler_over(cache) -> Scheduler:
    """A Scheduler whose tree is ``cache`` (what the sampling hooks read), built without start-up."""
    scheduler = object.__new__(Scheduler)
    scheduler.tree_cache = cache
    return scheduler


def batch(mode: str, extend: int, seconds: float, forward_iter: int) -> ScheduleBatch:
    b = ScheduleBatch(reqs=[], forward_mode=ForwardMode[mode], extend_lens=[extend], prefix_lens=[0],
                      launch_ts=T0 - seconds)
    b.forward_iter = forward_iter
    return b


@pytest.fixture
def sampled(tmp_path, kit_on_cpu, monkeypatch, cpu_shims):
    """A real cache with the streaming test backend (empty store), the cost plugin off, the clock at ``T0``."""
    monkeypatch.setattr(prefill_samples, "_every_batch", False)
    monkeypatch.setattr(prefill_samples, "_clock", lambda: T0)
    caches: list = []
    try:
        env = hicache(kit_on_cpu, tmp_path, caches)
        assert stream_core.active(env.cache) is not None
        yield env
    finally:
        close_all(caches)


def test_streaming_feeds_the_prefill_model_once_per_batch(sampled, monkeypatch) -> None:
    env, sampler = sampled, sampled.backend.cost.prefill
    scheduler = scheduler_over(env.cache)
    warm = cost_inputs.WARMUP_BATCHES
    for i in range(warm + 4):  # 1 ms per token
        stream_sample.record_prefill(None, scheduler, batch("EXTEND", 100 * (i + 1), 0.1 * (i + 1), i))
    assert sampler.estimator.samples == 4 and sampler.model() is not None  # measured: the gate's model
    assert sampler.model().time(1000, 0) == pytest.approx(1.0, rel=1e-6)
    stream_sample.record_prefill(None, scheduler, batch("DECODE", 1, 0.5, 90))
    stalled = batch("EXTEND", 300, 9.0, 91)  # its forward waited on a tail group: compute + stall
    batch_marks.note_batch(scheduler, stalled, waits=2, seconds=8.7, tail_bytes=1 << 20)
    stream_sample.record_prefill(None, scheduler, stalled.copy())  # the overlap loop processes a copy
    assert sampler.estimator.samples == 4 and not scheduler.__dict__[batch_marks.MARKS_ATTR]  # mark taken
    costs = require_side(env.backend).stream_costs
    assert costs.snapshot().interference_samples == 0  # a stalled forward is no sample of either kind
    stream_sample.record_prefill(None, scheduler, batch("MIXED", 200, 0.2, 92))
    assert sampler.estimator.samples == 5
    for i, mb in enumerate((1, 2)):  # ran beside 1 / 2 MB of tails, never waited: 0.1 s / 0.2 s over the model
        streamed = batch("EXTEND", 300, 0.3 + 0.1 * mb, 95 + i)
        batch_marks.note_batch(scheduler, streamed, waits=0, seconds=0.0, tail_bytes=mb * 1_000_000)
        stream_sample.record_prefill(None, scheduler, streamed)
    assert sampler.estimator.samples == 5  # compute + interference: not a prefill sample
    assert costs.interference_s_per_byte(sampler.model().batch_time) == pytest.approx(0.1 / 1e6, rel=1e-6)  # k

    monkeypatch.setattr(prefill_samples, "_every_batch", True)  # the cost plugin is on too: both hooks run on each batch
    for hook in (prefetch.record_prefill_timing, stream_sample.record_prefill):
        hook(None, scheduler, batch("EXTEND", 400, 0.4, 93))
    assert sampler.estimator.samples == 6  # one sample, not two
    stalled = batch("EXTEND", 500, 9.0, 94)
    batch_marks.note_batch(scheduler, stalled, waits=1, seconds=8.5, tail_bytes=1 << 20)
    for hook in (prefetch.record_prefill_timing, stream_sample.record_prefill):
        hook(None, scheduler, stalled)
    assert sampler.estimator.samples == 6  # the cost plugin's hook skips a stalled batch too
    assert env.backend.telemetry().boundary.total == 0



def test_hits_the_rule_decided_are_timed_to_their_first_token(sampled) -> None:
    """The bind rule's measured comparison: a hit's op start to the handled result of the batch that gave its
    request's first token is a sample of its path when the batch was that request alone and ran as its path
    says; any other batch drops it (``batch_marks.first_tokens``)."""
    from sgl_kvtier.experiments.streaming.rules.bind import BindVerdict

    env = sampled
    scheduler, costs = scheduler_over(env.cache), require_side(env.backend).stream_costs
    mb = 1_000_000

    def first_token(rid: str, path: BindVerdict, forward_iter: int, *, tails: int = 0, waits: int = 0,
                    failed: bool = False, first: bool = True, others: int = 0) -> None:
        costs.begin_hit(rid, path, T0 - 1.0, mb)  # its op started 1 s before the result is handled
        reqs = [new_req(rid), *(new_req(f"{rid}-other{i}") for i in range(others))]
        reqs[0].output_ids = [7] if first else []  # no token yet: a chunk of a chunked prefill
        b = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND, extend_lens=[64] * len(reqs),
                          prefix_lens=[1536] * len(reqs), launch_ts=T0 - 0.3)
        b.forward_iter = forward_iter
        batch_marks.note_batch(scheduler, b, waits=waits, seconds=0.1 * waits, tail_bytes=tails, failed=failed)
        stream_sample.record_prefill(None, scheduler, b)
        assert costs.timing(rid) is None  # sampled or dropped, never left pending

    def hits() -> tuple[int, int]:
        snap = costs.snapshot()
        return snap.measured_whole_hits, snap.measured_stream_hits

    first_token("whole", BindVerdict.WHOLE, 1)
    first_token("stalled", BindVerdict.STREAM, 2, tails=mb, waits=2)  # a stall is the streamed path's own cost
    assert hits() == (1, 1)
    first_token("failed", BindVerdict.STREAM, 3, tails=mb, failed=True, waits=1)  # retracted: no sample
    first_token("not streamed", BindVerdict.STREAM, 4)  # bound, then dropped: its forward ran without a tail
    first_token("beside a tail", BindVerdict.WHOLE, 5, tails=mb)  # another request's tail in its batch
    first_token("in company", BindVerdict.WHOLE, 6, others=1)
    first_token("chunked", BindVerdict.WHOLE, 7, first=False)
    assert hits() == (1, 1) and env.backend.telemetry().boundary.total == 0
    for rid, path, it in (("whole2", BindVerdict.WHOLE, 8), ("stream2", BindVerdict.STREAM, 9)):
        first_token(rid, path, it, tails=mb if path is BindVerdict.STREAM else 0)
    snap = costs.snapshot(lambda shape: 0.25)  # a prefill model of 0.25 s for the batch: 0.75 s over it per MB
    assert hits() == (2, 2) and snap.measured_whole_s_per_mb == pytest.approx(0.75)
    assert snap.measured_stream_s_per_mb == pytest.approx(0.75)

def test_no_sample_when_the_cache_does_not_stream(tmp_path, kit_on_cpu, monkeypatch, cpu_shims) -> None:
    monkeypatch.setattr(prefill_samples, "_every_batch", False)
    caches: list = []
    try:
        env = hicache(kit_on_cpu, tmp_path, caches, backend="KVTierStorage")  # streaming = "off"
        scheduler = scheduler_over(env.cache)
        for i in range(cost_inputs.WARMUP_BATCHES + 1):
            stream_sample.record_prefill(None, scheduler, batch("EXTEND", 64, 0.1, i))
        assert stream_core.active(env.cache) is None and env.backend.cost.prefill.estimator.samples == 0
    finally:
        close_all(caches)


def test_once_measured_the_gate_admits_by_the_model(consumer, monkeypatch) -> None:
    """Before any sample the gate waits for group 0 (the fallback); once our hook fed a model of a slow
    prefill, the same tail at the same rate is let through before any group landed."""
    env = consumer
    monkeypatch.setattr(prefill_samples, "_every_batch", False)
    monkeypatch.setattr(prefill_samples, "_clock", lambda: T0)
    req = new_req("r-model")
    registry = registered(env, req, head=2)
    tail = registry.get(req.rid)
    tail.stream.rate = 1e9  # the rest of the read takes well under a millisecond
    assert env.backend.cost.prefill.model() is None
    assert env.cache.check_prefetch_progress(req.cache_request_handle) is False  # unmeasured: group 0 first
    scheduler = scheduler_over(env.cache)
    for i in range(cost_inputs.WARMUP_BATCHES + 4):  # 10 ms per token: the suffix's compute hides the read
        stream_sample.record_prefill(None, scheduler, batch("EXTEND", 10 * (i + 1), 0.1 * (i + 1), i))
    model = env.backend.cost.prefill.model()
    assert model is not None and model.time(100, 0) == pytest.approx(1.0, rel=1e-6)
    assert env.cache.check_prefetch_progress(req.cache_request_handle) is True and tail.state is TailState.READY
    assert tail.stream.landed_groups == 0  # admitted by the model: no group had landed
    tail.stream.finish()  # the READY tail goes at the detach
