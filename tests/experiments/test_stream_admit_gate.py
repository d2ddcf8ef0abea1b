"""The admission gate and the bind rule of a streamed L3 tail (``plugins.stream_admit``,
``plugins.stream_bind``): when a bound tail's request is admitted (the read hidden under the suffix's
compute on the store's measured bandwidth and the learned prefill model, another request in the engine,
one streamed hit at a time) and which hits are bound at all, through the same REAL SGLang cache, controller,
pools and ``PrefillAdder`` as ``test_stream_admit`` (the life of a tail), with its test double of a stream
(``stream_kit``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

if torch.cuda.is_available():  # pragma: no cover - CPU pools and the CPU shims
    pytest.skip("CPU harness", allow_module_level=True)

from hook_kit import install_hooks  # noqa: E402
from stream_kit import (  # noqa: E402
    N_TOKENS,
    SUFFIX,
    admit,
    consumer_over_stored_prompt,
    new_req,
    reap_all,
    registered,
)

from sgl_kvtier.experiments.streaming.backend_side import require_side
from sgl_kvtier.experiments.streaming.contract import TailState  # noqa: E402
from sgl_kvtier.experiments.streaming.hooks import admit as stream_admit  # noqa: E402
from sgl_kvtier.experiments.streaming.hooks import bind as stream_bind
from sgl_kvtier.experiments.streaming.hooks import core as stream_core
from sgl_kvtier.experiments.streaming.hooks import slots as stream_slots
from sgl_kvtier.experiments.streaming.rules.bind import BindVerdict  # noqa: E402
from sgl_kvtier.sglang import plugins  # noqa: E402

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture
def consumer(tmp_path, kit_on_cpu, cpu_shims, monkeypatch):
    """A cache with the admission and host-slot hooks over a store holding the prompt (``stream_kit``)."""
    install_hooks(monkeypatch, [*stream_admit.HOOKS, *stream_slots.HOOKS])
    with consumer_over_stored_prompt(kit_on_cpu, tmp_path, monkeypatch) as env:
        yield env


# ---------------------------------------------------------------------------------------------- the gate
def test_the_gate_uses_the_measured_rate_and_prefill_model(consumer, monkeypatch):
    from sgl_kvtier.policy.cost_model import PrefillModel

    env = consumer
    env.backend.cost.prefill.estimator.seed = PrefillModel(1.0, 0.0, 0.0)  # 1 s per token: long suffix compute
    req = new_req("r-hides")
    registry = registered(env, req, head=2)
    tail = registry.get(req.rid)
    tail.stream.rate = 1e9  # the rest of the read hides under the suffix's compute: READY before any group
    assert env.cache.check_prefetch_progress(req.cache_request_handle) and tail.state is TailState.READY
    stream_core.drop(env.cache, registry, tail, "next case")  # one streamed hit at a time (the alone rule)
    tail.stream.finish()
    reap_all(env, registry)

    env.backend.cost.prefill.estimator.seed = PrefillModel(1e-9, 0.0, 0.0)  # recomputing costs nothing
    req2 = new_req("r-slow")
    tail2 = registered(env, req2, head=2).get(req2.rid)
    tail2.stream.rate = 1.0  # 1 B/s: waiting is slower than recomputing the tail
    tail2.stream.land(0)  # even with group 0 there: the measured rule decides, not the fallback
    # without the cost policy a slow tail is waited for (as a hit loaded whole would be)
    assert not env.cache.check_prefetch_progress(req2.cache_request_handle) and tail2.state is TailState.REGISTERED
    monkeypatch.setitem(plugins._status, "cost_policy", plugins.ON)  # its plugin runs: recomputing is its call
    assert env.cache.check_prefetch_progress(req2.cache_request_handle) and tail2.state is TailState.DROPPED


def test_the_gate_hides_the_read_under_the_prompts_own_suffix_when_sglang_knows_the_hit_end(consumer):
    """An L3 retry knows where the hit ends (``storage_hit_end``) and SGLang's op then spans only the hit: the
    gate still weighs the read against the compute of the whole suffix after the tail (``SUFFIX`` tokens)."""
    from sgl_kvtier.policy.cost_model import PrefillModel

    env = consumer
    env.backend.cost.prefill.estimator.seed = PrefillModel(1.0, 0.0, 0.0)  # 1 s per token
    req = new_req("r-known-end")
    registry = registered(env, req, head=2, storage_hit_end=N_TOKENS)
    tail = registry.get(req.rid)
    assert tail is not None and tail.token_end == N_TOKENS
    # the rest of the read takes (1 - 1/G) * SUFFIX - 1 seconds: hidden under the suffix's SUFFIX seconds (it would
    # not be under one token's second, nor faster than recomputing the tail: the request would wait)
    hidden_s = (1 - 1 / tail.stream.groups) * SUFFIX - 1
    tail.stream.rate = tail.stream.remaining_bytes(tail.first_page) / hidden_s
    assert env.cache.check_prefetch_progress(req.cache_request_handle) and tail.state is TailState.READY
    stream_core.drop(env.cache, registry, tail, "test over")
    tail.stream.finish()
    reap_all(env, registry)


def test_the_gate_counts_the_learned_interference_in_the_forward_the_read_hides_under(consumer):
    """The forward of a request whose tail lands meanwhile runs longer by the bind rule's learned ``k`` x the
    tail's bytes: the read the gate lets hide under it grows by ``(1 - 1/G)`` of that."""
    from sgl_kvtier.policy.cost_model import PrefillModel

    env = consumer
    env.backend.cost.prefill.estimator.seed = PrefillModel(1.0, 0.0, 0.0)  # 1 s per token
    over_s = 1.0  # the rest of the read: 1 s over what the suffix's own compute hides

    def poll(rid: str, k_s: float = 0.0) -> tuple[bool, object]:
        req = new_req(rid)
        registry = registered(env, req, head=2, storage_hit_end=N_TOKENS)
        tail = registry.get(req.rid)
        tail_bytes = env.backend.kv.pages.bytes_of(tail.tokens)
        for _ in range(2 if k_s else 0):  # k learned after the bind (with it, the bind rule would load whole):
            # forwards of this tail's bytes ``k_s`` over the model's 8 s for their batch
            require_side(env.backend).stream_costs.record_stream_forward(tail_bytes, [(8, 8)], 8.0 + k_s)
        tail.stream.rate = tail.stream.remaining_bytes(tail.first_page) / (
            (1 - 1 / tail.stream.groups) * SUFFIX + over_s)
        answer = env.cache.check_prefetch_progress(req.cache_request_handle)
        stream_core.drop(env.cache, registry, tail, "next case")
        tail.stream.finish()
        reap_all(env, registry)
        return answer, tail

    answer, tail = poll("r-no-k")
    assert not answer and tail.state is TailState.DROPPED  # waited (dropped only to end the case)
    answer, tail = poll("r-k", k_s=2.0)  # (1 - 1/G) x 2 s >= 1 s more read hides: admitted
    assert answer and tail.state is TailState.DROPPED and stream_admit.STATS.ready >= 1


def test_before_a_second_landing_the_gate_takes_the_stores_measured_bandwidth(consumer, monkeypatch):
    """Group 0 landed and nothing after it: the stream's rate, counted from its thread's start, is lifted to
    the store's measured read bandwidth (the cost policy's read path), so the gate can open at group 0."""
    from sgl_kvtier.estimation import DeviceModel
    from sgl_kvtier.policy.cost_inputs import ReadPath
    from sgl_kvtier.policy.cost_model import PrefillModel

    env = consumer
    env.backend.cost.prefill.estimator.seed = PrefillModel(1.0, 0.0, 0.0)  # 1 s per token
    pages = env.backend.kv.pages

    def poll(rid: str, device_Bps: float | None, settled: bool) -> tuple[bool, object]:
        req = new_req(rid)
        registry = registered(env, req, head=2, storage_hit_end=N_TOKENS)
        tail = registry.get(req.rid)
        tail.stream.land(0)
        read_s = (1 - 1 / tail.stream.groups) * SUFFIX  # what the suffix's compute hides
        remaining = tail.stream.remaining_bytes(tail.first_page)
        tail.stream.rate, tail.stream.rate_is_settled = remaining / (2 * read_s), settled  # half the rate that hides
        path = None if device_Bps is None else ReadPath(pages.page_tokens, pages.page_bytes,
                                                        DeviceModel(device_Bps, 0.0))
        with monkeypatch.context() as patch:  # after the bind (its rule reads the read path too)
            patch.setattr(env.backend.cost, "read_path", lambda: path)
            answer = env.cache.check_prefetch_progress(req.cache_request_handle)
        stream_core.drop(env.cache, registry, tail, "next case")
        tail.stream.finish()
        reap_all(env, registry)
        return answer, tail

    assert poll("r-no-figure", None, settled=False)[0] is False  # no store figure: the stream's own rate, waits
    assert poll("r-settled", 1e18, settled=True)[0] is False  # counted between landings: the stream's own, waits
    ready = stream_admit.STATS.ready
    answer, _ = poll("r-early", 1e18, settled=False)  # the store reads far faster than the stream's first figure
    assert answer and stream_admit.STATS.ready == ready + 1


class Scheduled:
    """The scheduler's queues the gate reads (weakly referenced, as SGLang's ``Scheduler``)."""

    def __init__(self, **attrs) -> None:
        self.__dict__.update(attrs)


def test_with_another_request_in_the_engine_a_tail_is_admitted_only_once_landed_whole(consumer):
    """Another request running or waiting (the scheduler noted after a batch): the gate holds a tail until it
    landed whole (its forward would hold theirs too), and a hit arriving then is not bound (loads whole)."""

    from sgl_kvtier.policy.cost_model import PrefillModel

    env = consumer
    env.backend.cost.prefill.estimator.seed = PrefillModel(1.0, 0.0, 0.0)  # 1 s per token: everything hides
    req = new_req("r-busy")
    registry = registered(env, req, head=2)
    tail = registry.get(req.rid)
    tail.stream.rate = 1e9
    other = SimpleNamespace(rid="r-other")
    scheduler = Scheduled(tree_cache=env.cache, running_batch=SimpleNamespace(reqs=[other]), waiting_queue=[req])
    stream_core.note_scheduler(scheduler)
    assert stream_core.others_in_engine(env.cache, req.rid)
    assert not env.cache.check_prefetch_progress(req.cache_request_handle) and tail.state is TailState.REGISTERED
    other.finished = lambda: True  # the other one finished (still listed until the scheduler's next step)
    assert not stream_core.others_in_engine(env.cache, req.rid)
    scheduler.running_batch.reqs = []
    other = SimpleNamespace(rid="r-other-2")
    scheduler.waiting_queue = [other, req]  # another one waits: busy again
    assert not env.cache.check_prefetch_progress(req.cache_request_handle)
    for g in range(tail.stream.groups):
        tail.stream.land(g)  # landed whole: admitted as a hit loaded whole is
    assert env.cache.check_prefetch_progress(req.cache_request_handle) and tail.state is TailState.READY
    stream_core.drop(env.cache, registry, tail, "next case")
    tail.stream.finish()
    reap_all(env, registry)

    before, streams = stream_admit.STATS.not_registered["busy: loaded whole"], len(require_side(env.backend).binder.streams)
    req2 = new_req("r-busy-bind")
    scheduler.waiting_queue = [other, req2]
    registered(env, req2, head=0)  # nothing else in flight, no tail: only the other request makes it busy
    assert registry.get(req2.rid) is None and len(require_side(env.backend).binder.streams) == streams
    assert stream_admit.STATS.not_registered["busy: loaded whole"] == before + 1
    del scheduler  # the cache holds it weakly: unknown again, as before a first batch
    assert not stream_core.others_in_engine(env.cache, "r-any")


def test_a_hit_while_another_tail_streams_loads_whole(consumer):
    """The alone rule: only a hit no other request's L3 work overlaps is streamed; a second one, arriving
    while the first one's tail streams, is read whole before its admission (today's path) and never sees
    the first's tail (private until its forward succeeded)."""
    env = consumer
    first = new_req("r-first")
    registry = registered(env, first, head=3)
    tail = registry.get(first.rid)
    assert tail is not None
    before = stream_admit.STATS.not_registered["busy: loaded whole"]
    second = new_req("r-second")
    registered(env, second, head=0)
    assert len(require_side(env.backend).binder.streams) == 1 and registry.get(second.rid) is None
    assert stream_admit.STATS.not_registered["busy: loaded whole"] == before + 1
    admit(env, second)
    assert second.prefix_len == N_TOKENS  # the first's head from the tree, the rest read whole from L3
    stream_core.drop(env.cache, registry, tail, "test over")
    tail.stream.finish()
    reap_all(env, registry)


def test_the_hit_is_bound_in_the_read_groups_the_read_rule_cuts(consumer, monkeypatch, caplog):
    """``experiments.streaming.rules.read_groups`` is asked with the pool's layer groups, the hit's predicted read (the store's read
    model), its suffix's compute (the prefill model's), its pages and K|V ranges, and the binder is handed its
    cut (logged when it changes, at most every CUTS_LOG_EVERY_S); the bind rule weighs the hit in that cut's
    shares."""
    from sgl_kvtier.estimation import DeviceModel
    from sgl_kvtier.policy.cost_inputs import ReadPath

    env = consumer
    pages = env.backend.kv.pages
    model = DeviceModel(1e9, 1e-3)
    monkeypatch.setattr(env.backend.cost, "read_path", lambda: ReadPath(pages.page_tokens, pages.page_bytes, model))
    asked: list[tuple] = []
    cut = (0, 1, pages.plan.group_count)
    monkeypatch.setattr(stream_bind, "read_cuts", lambda *a: asked.append(a) or cut)
    weighed: list[tuple] = []
    decide = require_side(env.backend).stream_costs.decide
    monkeypatch.setattr(require_side(env.backend).stream_costs, "decide", lambda *a: weighed.append(a) or decide(*a))
    req = new_req("r-groups")
    with caplog.at_level("INFO", logger=stream_bind.logger.name):
        registry = registered(env, req, head=3)
    tail = registry.get(req.rid)
    assert tail is not None and require_side(env.backend).binder.cuts == [cut]
    assert sum(f"read in layer groups {cut}" in r.getMessage() for r in caplog.records) == 1  # a new cut: said
    ((bounds, read_s, compute_s, n, ranges),) = asked
    assert (bounds, n, ranges) == (pages.plan.bounds, require_side(env.backend).binder.streams[0].pages, 2)
    assert read_s == pytest.approx(model.load_time(n, pages.page_bytes))
    prefill = env.backend.cost.prefill.model()
    assert (compute_s is None) == (prefill is None)
    ((_, groups, _, weighed_compute, _, shares),) = weighed
    first = len(pages.plan.layers(0)) / pages.plan.num_layers
    assert groups == 2 and weighed_compute == compute_s and shares == pytest.approx((first, 1 - first))
    stream_core.drop(env.cache, registry, tail, "test over")
    tail.stream.finish()
    reap_all(env, registry)
    # hits of other sizes change the cut: logged again only CUTS_LOG_EVERY_S after the last line
    logged_at = stream_bind._last_cuts[env.backend][1]
    other = (0, 2, pages.plan.group_count)
    monkeypatch.setattr(stream_bind, "read_cuts", lambda *a: other)
    costs = stream_bind._HitCosts(0.1, 0.5, None)
    for dt, said in ((1.0, 0), (stream_bind.CUTS_LOG_EVERY_S, 1)):
        monkeypatch.setattr(stream_bind, "_clock", lambda dt=dt: logged_at + dt)
        caplog.clear()
        with caplog.at_level("INFO", logger=stream_bind.logger.name):
            assert stream_bind._read_cuts(env.backend, 4, costs) == other
        assert sum(f"read in layer groups {other}" in r.getMessage() for r in caplog.records) == said


def test_the_bind_rule_loads_whole_a_hit_it_predicts_no_faster_and_times_that_load(consumer, monkeypatch):
    """With the store's read model, the prefill model and a learned interference that the overlap cannot win
    back, the hit is not bound: it is read whole before admission (today's path), and that load, alone, is
    the rule's sample of the whole-load wait."""
    from sgl_kvtier.estimation import DeviceModel
    from sgl_kvtier.policy.cost_inputs import ReadPath
    from sgl_kvtier.policy.cost_model import PrefillModel

    env = consumer
    pages = env.backend.kv.pages
    monkeypatch.setattr(env.backend.cost, "read_path", lambda: ReadPath(pages.page_tokens, pages.page_bytes,
                                                                        DeviceModel(1e9, 1e-3)))
    env.backend.cost.prefill.estimator.seed = PrefillModel(1e-3, 0.0, 0.0)
    costs = require_side(env.backend).stream_costs
    for n in (1, 2):  # 1 s of forward over the model per MB of tail: never worth it
        costs.record_stream_forward(n * 1_000_000, [(8, 8)], 8e-3 + n * 1.0)
    reason = "predicted no faster: loaded whole"
    before = stream_admit.STATS.not_registered[reason]
    req = new_req("r-whole")
    registry = registered(env, req, head=3)
    assert require_side(env.backend).binder.streams == [] and len(registry) == 0
    assert stream_admit.STATS.not_registered[reason] == before + 1
    assert costs.snapshot().whole_samples == 1  # the load from its op's start to its handled result
    assert costs.timing(req.rid) is BindVerdict.WHOLE  # and its request is timed on to its first token
    admit(env, req)
    assert req.prefix_len == N_TOKENS and req.host_hit_length == N_TOKENS  # the whole hit, from L3 via L2
