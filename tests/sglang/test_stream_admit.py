"""The admission side of a streamed L3 tail (``plugins.stream_admit``), through SGLang 0.5.23's REAL
``UnifiedRadixCache`` + ``HybridCacheController`` (its prefetch, IO and sync threads), real CPU host and
device pools, a real ``Req``, SGLang's own ``Scheduler._prefetch_kvcache`` and a real ``PrefillAdder``.

A producer cache backs a prompt up to our L3 store (write-through, as a server does). A consumer cache
then fetches it with the stream hooks on (``stream_admit.HOOKS`` and ``stream_slots.HOOKS`` only: the
forward side is another module's) and a backend whose stream is a test double (``StreamingTestStorage``: a ``KVTierStorage``
whose ``bind_hit`` / ``binder`` are a ``FakeBinder`` of ``FakeStream``\\ s with controllable groups): the
head pages it answers True to SGLang's IO thread are read from the real store into their slots first,
and landing a group of the tail reads the tail pages' real bytes into their withheld slots. An IO in
flight is simulated: a cancelled stream ends only when the test says so (``finish``).

Waits are on the controller's own queues (an event set by their ``put``), bounded by a deadline.
"""

from __future__ import annotations

import threading
from array import array
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

if torch.cuda.is_available():  # pragma: no cover - CPU pools and the CPU shims
    pytest.skip("CPU harness", allow_module_level=True)

from hook_kit import install_hooks  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from stream_kit import (  # noqa: E402
    DEADLINE_S,
    LAYERS,
    N_PAGES,
    N_TOKENS,
    PS,
    SUFFIX,
    TOKENS,
    Queues,
    adder_for,
    admit,
    arrive,
    close_all,
    hicache,
    kv_buffers,
    new_req,
    open_consumer,
    reap_all,
    registered,
    store_prompt,
    tree_device_tokens,
)

from sgl_kvtier.policy.stream_bind import BindVerdict  # noqa: E402
from sgl_kvtier.sglang.plugins import (  # noqa: E402
    prefetch,
    stream,
    stream_admit,
    stream_bind,
    stream_core,
    stream_slots,
)
from sgl_kvtier.sglang.stream.contract import TailState  # noqa: E402

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture
def hooks(monkeypatch, cpu_shims):
    """The admission hooks applied to SGLang's classes; registry and classes restored afterwards."""
    install_hooks(monkeypatch, [*stream_admit.HOOKS, *stream_slots.HOOKS])


@pytest.fixture
def stored(tmp_path, kit_on_cpu, hooks, monkeypatch):
    """The prompt's first ``N_PAGES`` pages in our L3 store, and their KV bytes per token row."""
    return store_prompt(kit_on_cpu, tmp_path, monkeypatch)


@pytest.fixture
def consumer(stored, kit_on_cpu, monkeypatch):
    caches: list = []
    try:
        yield open_consumer(kit_on_cpu, stored, monkeypatch, caches)
    finally:
        close_all(caches)


# ---------------------------------------------------------------------------------------------- the life of a tail
def test_register_gate_match_load_back_own_and_rows(consumer):
    env, req = consumer, new_req("r-stream")
    registry = registered(env, req, head=3)
    tail = registry.get(req.rid)
    assert tail is not None and tail.state is TailState.REGISTERED
    assert env.backend.stream_costs.timing(req.rid) is BindVerdict.STREAM  # the rule's choice, timed to its token
    assert (tail.first_page, tail.token_start, tail.tokens) == (3, 3 * PS, (N_PAGES - 3) * PS)
    stream_ = tail.stream
    assert torch.equal(tail.host_indices, stream_.host_indices[3 * PS:])
    assert env.backend.binder.claims == []  # SGLang released none of the tail's slots: all withheld
    assert env.host.available_size() == env.host_baseline - N_TOKENS  # head in the tree + tail withheld

    # the gate: group 0 not landed -> skipped (not blocking); landed -> READY
    assert env.cache.check_prefetch_progress(req.cache_request_handle) is False
    stream_.land(0)
    adder, res = admit(env, req)
    assert tail.state is TailState.ADMITTED and res is not None
    # SGLang's L3 attribution of the request: the head's span, grown by the tail once it is admitted
    assert (req.storage_hit_start, req.storage_hit_length) == (0, N_TOKENS)
    assert adder.can_run_list == [req]
    assert req.prefix_len == N_TOKENS and req.kv.cache_protected_len == 3 * PS  # the tail is request-owned
    assert tail.device_indices is not None and len(tail.device_indices) == tail.tokens
    assert env.alloc.available_size() == env.device_baseline - N_TOKENS  # tree part + private tail slots
    assert env.kit.match_prefix(env.cache, TOKENS[:N_TOKENS]).device_prefix_len == 3 * PS  # only the head

    # row indices: the tree path, then the private slots
    rows = env.cache.prefix_device_indices(req)
    path = env.cache.tree_core.collect_full_device_indices(req.last_node, env.cache.root_node_handle())
    assert torch.equal(rows, torch.cat([path, tail.device_indices]))

    # stand-in for the forward side: HiCache's own H2D of the head, the tail's groups copied by layer
    assert env.cache.ready_to_load_host_cache() >= 0
    assert registry.take_queued() == [tail] and tail.state is TailState.LOADING
    stream_.land(1)
    for layer in range(LAYERS):
        env.host.load_to_device_per_layer(env.alloc.get_kvcache(), tail.host_indices, tail.device_indices, layer,
                                          "direct")
    env.queues.pump(env.cache, lambda: not env.cc.ack_load_queue, "the head's H2D ack")
    for buf, original in zip(kv_buffers(env.alloc), env.original, strict=True):  # byte-exact, every layer
        assert torch.equal(buf.view(torch.uint8)[rows], original)

    # after a good forward the forward side forgets the tail and defers its host slots
    registry.remove(req.rid)
    tail.state = TailState.DONE
    registry.defer_free(stream_, tail.host_indices)
    env.cache.check_hicache_events()
    assert registry.deferred() == 1  # its IO has not ended: nothing freed under a read
    stream_.finish()
    reap_all(env, registry)
    assert env.host.available_size() == env.host_baseline - 3 * PS  # only the head, in the tree's host nodes

    # the request's own KV: a retract-like release frees the tail's device slots, the tree keeps its part
    env.req_pool.alloc([req])
    env.req_pool.write((req.kv.req_pool_idx, slice(0, N_TOKENS)), rows.to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = N_TOKENS
    release_kv_cache(req, env.cache, checkpoint=False)
    assert env.alloc.available_size() + tree_device_tokens(env.cache) == env.device_baseline


def test_after_a_good_forward_the_request_inserts_its_tail(consumer):
    env, req = consumer, new_req("r-done")
    registry = registered(env, req, head=3)
    tail = registry.get(req.rid)
    tail.stream.land(0)
    adder, _ = admit(env, req)
    rows = env.cache.prefix_device_indices(req)
    assert env.cache.ready_to_load_host_cache() >= 0 and registry.take_queued() == [tail]
    tail.stream.land(1)
    for layer in range(LAYERS):  # stand-in for the forward side's loader
        env.host.load_to_device_per_layer(env.alloc.get_kvcache(), tail.host_indices, tail.device_indices, layer,
                                          "direct")
    env.queues.pump(env.cache, lambda: not env.cc.ack_load_queue, "the head's H2D ack")
    registry.remove(req.rid)  # the forward side's verdict: landed, DONE
    tail.state = TailState.DONE
    registry.defer_free(tail.stream, tail.host_indices)
    tail.stream.finish()
    env.req_pool.alloc([req])  # the row prepare_for_extend writes (prefix only: no suffix computed here)
    env.req_pool.write((req.kv.req_pool_idx, slice(0, N_TOKENS)), rows.to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = N_TOKENS
    release_kv_cache(req, env.cache, checkpoint=True)  # the request's own insert, like computed KV
    match = env.kit.match_prefix(env.cache, TOKENS[:N_TOKENS])
    assert match.device_prefix_len == N_TOKENS  # the tail is tree KV now, in the slots it was loaded into
    assert torch.equal(env.cache.path_device_indices(match.last_device_node), rows)
    assert env.alloc.available_size() + tree_device_tokens(env.cache) == env.device_baseline
    reap_all(env, registry)  # the withheld slots are back; the tail's write-through backup took new ones
    assert env.cache.tree_core.is_backuped(match.last_device_node)  # write-through, like computed KV
    assert env.host.available_size() == env.host_baseline - N_TOKENS  # head + the tail's backup, in the tree


# ---------------------------------------------------------------------------------------------- dropped paths
def test_failed_group_drops_at_the_gate_and_slots_wait_for_the_io(consumer):
    env, req = consumer, new_req("r-fail")
    registry = registered(env, req, head=2)
    tail = registry.get(req.rid)
    tail.stream.fail(0)  # group 0 failed on a tail page before admission
    adder, _ = admit(env, req)
    assert tail.state is TailState.DROPPED and registry.get(req.rid) is None and tail.stream.cancelled
    assert adder.can_run_list == [req]
    assert req.prefix_len == 2 * PS and req.kv.cache_protected_len == 2 * PS  # the head only: the rest computes
    assert env.cache.prefix_device_indices(req).numel() == 2 * PS
    env.cache.check_hicache_events()
    assert registry.deferred() == 1  # a read may still land in the tail's slots: not freed
    assert env.host.available_size() == env.host_baseline - N_TOKENS
    tail.stream.finish()
    reap_all(env, registry)
    assert env.host.available_size() == env.host_baseline - 2 * PS


def test_the_gate_gives_up_at_the_deadline(consumer, monkeypatch):
    env, req = consumer, new_req("r-late")
    now = [1000.0]
    monkeypatch.setattr(stream_admit, "_clock", lambda: now[0])
    registry = registered(env, req, head=0)
    tail = registry.get(req.rid)
    assert tail.token_start == 0 and tail.tokens == N_TOKENS  # nothing had landed: the whole hit is the tail
    assert env.cache.check_prefetch_progress(req.cache_request_handle) is False
    now[0] += env.cache.prefetch_timeout_base + N_PAGES * env.cache.prefetch_timeout_per_page
    assert env.cache.check_prefetch_progress(req.cache_request_handle) is True
    assert tail.state is TailState.DROPPED and stream_admit.STATS.dropped["gate"] >= 1
    tail.stream.finish()
    reap_all(env, registry)
    assert env.host.available_size() == env.host_baseline


def test_a_rank_that_cannot_stream_vetoes_the_tail(consumer, monkeypatch):
    env, req = consumer, new_req("r-veto")
    votes: list[list[int]] = []

    def peer_says_no(cache, values):  # our collective, with a second rank whose every vote is 0
        votes.append(stream.min_reduce(cache, values))
        return [0] * len(values)

    monkeypatch.setattr(stream_admit, "min_reduce", peer_says_no)
    registry = registered(env, req, head=3)
    assert [1] in votes  # this rank could stream it
    assert registry.get(req.rid) is None and len(registry) == 0
    [stream_] = env.backend.binder.streams
    assert stream_.cancelled and registry.deferred() == 1  # taken by this rank: its tail slots are ours to free
    assert env.backend.binder.claims == [] and env.host.available_size() == env.host_baseline - N_TOKENS
    monkeypatch.setattr(stream_admit, "min_reduce", stream.min_reduce)
    adder, _ = admit(env, req)
    assert req.prefix_len == 3 * PS  # the head, loaded as today
    stream_.finish()
    reap_all(env, registry)
    assert env.host.available_size() == env.host_baseline - 3 * PS


def test_a_hit_over_the_withheld_cap_is_not_bound_and_loads_whole(consumer, monkeypatch):
    """The cap is judged when the hit is bound, before SGLang's IO thread asks: over it, the hit is read
    whole before admission as today (a hit bound and then refused would be recomputed)."""
    env, req = consumer, new_req("r-cap")
    monkeypatch.setattr(stream_bind, "MAX_WITHHELD", 0.0)
    before = stream_admit.STATS.not_registered["withheld cap: loaded whole"]
    registry = registered(env, req, head=3)
    assert env.backend.binder.streams == [] and len(registry) == 0 and registry.deferred() == 0
    assert stream_admit.STATS.not_registered["withheld cap: loaded whole"] == before + 1
    adder, _ = admit(env, req)
    assert req.prefix_len == N_TOKENS and req.host_hit_length == N_TOKENS  # the whole hit, from L3 via L2


def test_match_ending_elsewhere_drops_the_tail(consumer):
    env, req = consumer, new_req("r-moved")
    registry = registered(env, req, head=2)
    tail = registry.get(req.rid)
    tail.stream.land(0)
    assert env.cache.check_prefetch_progress(req.cache_request_handle) and tail.state is TailState.READY
    # another request computed the whole span meanwhile: the tree's match now ends past the tail's start
    value = env.alloc.alloc(N_TOKENS)
    env.cache.insert(InsertParams(key=RadixKey(array("q", TOKENS[:N_TOKENS])), value=value))
    req.init_next_round_input(env.cache)
    assert tail.state is TailState.DROPPED and req.host_hit_length == 0 and req.prefix_len == N_TOKENS
    # SGLang's L3 span of the request is the head's alone: a tail dropped before admission is never counted
    # as read from L3 (here those tokens are device hits another request computed)
    assert env.cache.pop_prefetch_loaded_span(req.cache_request_handle) == (2 * PS, 0)
    tail.stream.finish()
    reap_all(env, registry)


def test_abort_drops_a_waiting_tail(consumer):
    env, req = consumer, new_req("r-abort")
    registry = registered(env, req, head=1)
    tail = registry.get(req.rid)
    registry.block(req.rid)
    env.cache.release_aborted_request(req.cache_request_handle)
    assert tail.state is TailState.DROPPED and registry.get(req.rid) is None and not registry.is_blocked(req.rid)
    tail.stream.finish()
    reap_all(env, registry)
    assert env.host.available_size() == env.host_baseline - PS


# ---------------------------------------------------------------------------------------------- all or nothing
def test_no_device_room_for_the_tail_loads_nothing(consumer):
    env, req = consumer, new_req("r-full")
    registry = registered(env, req, head=2)
    tail = registry.get(req.rid)
    tail.stream.land(0)
    filler = env.alloc.alloc(env.alloc.available_size() - 3 * PS)  # room for the tree part, not the tail
    adder, res = admit(env, req)
    assert res is AddReqResult.NO_TOKEN and adder.can_run_list == []  # SGLang's verdict after "none loaded"
    assert tail.state is TailState.READY and tail.device_indices is None  # kept for the next round
    assert env.alloc.available_size() == 3 * PS  # neither the tail slots nor the tree part were taken
    assert req.host_loaded_length == 0
    env.alloc.free(filler)
    adder, res = admit(env, req)
    assert adder.can_run_list == [req] and tail.state is TailState.ADMITTED
    assert req.prefix_len == N_TOKENS and req.kv.cache_protected_len == 2 * PS


def test_a_load_back_the_adder_does_not_keep_is_undone(consumer, monkeypatch):
    env, req = consumer, new_req("r-undo")
    registry = registered(env, req, head=2)
    tail = registry.get(req.rid)
    tail.stream.land(0)
    adder = adder_for(env)
    monkeypatch.setattr(adder, "_commit_prefill_admission", lambda *a, **k: None)  # admitted after all: no
    before = env.alloc.available_size()
    admit(env, req, adder)
    assert adder.can_run_list == [] and tail.state is TailState.READY and tail.device_indices is None
    assert registry.take_queued() == []  # not queued for a batch it is not in
    assert env.alloc.available_size() == before - 2 * PS  # the tree part's load (SGLang's own) stays


# ---------------------------------------------------------------------------------------------- off, out of scope
def test_inert_when_streaming_is_off(stored, kit_on_cpu, monkeypatch):
    caches: list = []
    try:
        env = hicache(kit_on_cpu, stored.dir, caches, backend="KVTierStorage")  # streaming = "off" (the default)
        queues, baseline = Queues(env.cc, monkeypatch), env.host.available_size()
        req = new_req("r-off")
        arrive(env, req)
        assert stream.active(env.cache) is None
        queues.pump(env.cache, lambda: not env.cache.ongoing_prefetch, "the prefetch result")
        assert env.backend.binder.bound_pages() == 0 and len(stream.registry_of(env.cache)) == 0
        adder, _ = admit(env, req)
        assert adder.can_run_list == [req] and req.prefix_len == N_TOKENS  # the whole hit, loaded as today
        assert req.kv.cache_protected_len == N_TOKENS
        assert env.host.available_size() == baseline - N_TOKENS  # all of it in the tree's host nodes
    finally:
        close_all(caches)


def test_a_blocked_request_loads_its_hit_whole(consumer):
    env, req = consumer, new_req("r-blocked")
    stream.active(env.cache).block(req.rid)  # retracted once after a failed tail: never streams again
    arrive(env, req)
    env.queues.pump(env.cache, lambda: not env.cache.ongoing_prefetch, "the prefetch result")
    assert env.backend.binder.streams == [] and len(stream.active(env.cache)) == 0
    adder, _ = admit(env, req)
    assert req.prefix_len == N_TOKENS and req.kv.cache_protected_len == N_TOKENS


def test_scope_and_the_one_decision(consumer, caplog):
    env = consumer
    assert stream.scope_problems(env.cache) == []
    registry = stream.active(env.cache)
    assert registry is stream.registry_of(env.cache) and stream.active(env.cache) is registry
    env.cache.linker = object()
    assert "an external cache linker is attached" in stream.scope_problems(env.cache)
    env.cache.__dict__.pop(stream.ACTIVE_ATTR)
    with caplog.at_level("INFO", logger=stream_core.logger.name):
        assert stream.active(env.cache) is None and stream.active(env.cache) is None
    assert [r.getMessage() for r in caplog.records].count(
        f"kvtier streamed tails: off for this cache (pid {__import__('os').getpid()}): an external cache linker "
        "is attached") == 1
    env.cache.linker = None


def test_detach_frees(consumer):
    env, req = consumer, new_req("r-detach")
    registry = registered(env, req, head=2)
    tail = registry.get(req.rid)
    ok, msg = env.cache.detach_storage_backend()  # closes the backend: its streams end
    assert ok, msg
    assert tail.state is TailState.DROPPED and len(registry) == 0 and registry.deferred() == 0
    assert env.host.available_size() == env.host_baseline - 2 * PS  # the head, in the tree
    assert stream.active(env.cache) is None


def test_reset_forgets_without_freeing_into_the_cleared_pool(consumer):
    env, req = consumer, new_req("r-reset")
    registry = registered(env, req, head=2)
    tail = registry.get(req.rid)
    ender = threading.Thread(target=tail.stream.end_when_cancelled)  # its IO in flight ends after the cancel
    ender.start()
    env.cache.reset()  # flush: the host pool is cleared, every slot free again
    ender.join(DEADLINE_S)
    assert tail.stream.ended  # reset returned only once the stream had ended: no read lands after it
    assert tail.state is TailState.DROPPED and tail.stream.cancelled and len(registry) == 0
    assert registry.deferred() == 0 and env.host.available_size() == env.host.size  # no double free


def test_registered_slots_never_reach_sglangs_release(consumer):
    env, req = consumer, new_req("r-net")
    registry = registered(env, req, head=2)
    tail = registry.get(req.rid)
    errors, kept = env.backend.boundary.counts(), stream_admit.STATS.withheld_registered
    env.cc.append_host_mem_release(tail.host_indices)  # a release of a tail's slots (a bug upstream)
    env.cache.check_hicache_events()  # SGLang's drain of its release queue
    assert env.host.available_size() == env.host_baseline - N_TOKENS  # nothing of the tail was freed
    assert stream_admit.STATS.withheld_registered == kept + tail.tokens
    assert env.backend.boundary.counts().expected == errors.expected + 1  # counted, logged


def test_a_rolled_back_bounce_of_a_bound_hit_waits_for_its_stream(consumer):
    env = consumer
    registry = stream.active(env.cache)
    slots = env.host.alloc(2 * PS)
    hashes = [f"{i:064x}" for i in range(2)]
    env.backend.bind_hit(hashes, slots)  # bound, as after allocate_storage_hit
    [stream_] = env.backend.binder.streams
    env.cc.free_prefetch_host_buffers(SimpleNamespace(pool_transfers=None), slots)  # SGLang's direct rollback
    assert stream_.cancelled and registry.deferred() == 1
    assert env.host.available_size() == env.host_baseline - 2 * PS  # not freed under the stream's reads
    stream_.finish()
    reap_all(env, registry)
    assert env.host.available_size() == env.host_baseline


def test_an_early_cut_streams_nothing(consumer):
    env, req = consumer, new_req("r-early")
    env.cache.prefetch_stop_policy = "best_effort"  # cut at the first admission poll, IO maybe still running
    env.backend.binder.head = 2
    arrive(env, req)
    handle = req.cache_request_handle
    env.queues.pump(env.cache, lambda: env.cache.ongoing_prefetch[handle].host_indices is not None,
                    "the hit's host slots")
    op = env.cache.ongoing_prefetch[handle].operation
    assert len(env.backend.binder.streams) == 1  # bound at allocation
    assert env.cache.check_prefetch_progress(handle) is True  # SGLang's cut; our register stays out of it
    registry = stream.active(env.cache)
    assert len(registry) == 0 and op.ack_releases_incomplete_host_indices  # SGLang releases the rest itself
    env.queues.pump(env.cache, lambda: bool(env.backend.binder.claims), "the op's last ack")
    [(stream_, held)] = env.backend.binder.claims  # its unfinished pages: withheld until the stream ended
    assert stream_.cancelled and registry.deferred() == 1 and torch.equal(held, stream_.host_indices[2 * PS:])
    stream_.finish()
    reap_all(env, registry)
    assert env.host.available_size() == env.host_baseline - op.completed_tokens  # the cut's head, in the tree


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
    monkeypatch.setattr(prefetch, "_loaded", True)  # KVTIER_PREFETCH_POLICY=cost: recomputing is its call
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
            env.backend.stream_costs.record_stream_forward(tail_bytes, [(8, 8)], 8.0 + k_s)
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
    from types import SimpleNamespace

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

    before, streams = stream_admit.STATS.not_registered["busy: loaded whole"], len(env.backend.binder.streams)
    req2 = new_req("r-busy-bind")
    scheduler.waiting_queue = [other, req2]
    registered(env, req2, head=0)  # nothing else in flight, no tail: only the other request makes it busy
    assert registry.get(req2.rid) is None and len(env.backend.binder.streams) == streams
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
    assert len(env.backend.binder.streams) == 1 and registry.get(second.rid) is None
    assert stream_admit.STATS.not_registered["busy: loaded whole"] == before + 1
    admit(env, second)
    assert second.prefix_len == N_TOKENS  # the first's head from the tree, the rest read whole from L3
    stream_core.drop(env.cache, registry, tail, "test over")
    tail.stream.finish()
    reap_all(env, registry)


def test_the_hit_is_bound_in_the_read_groups_the_read_rule_cuts(consumer, monkeypatch, caplog):
    """``policy.stream_read`` is asked with the pool's layer groups, the hit's predicted read (the store's read
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
    decide = env.backend.stream_costs.decide
    monkeypatch.setattr(env.backend.stream_costs, "decide", lambda *a: weighed.append(a) or decide(*a))
    req = new_req("r-groups")
    with caplog.at_level("INFO", logger=stream_bind.logger.name):
        registry = registered(env, req, head=3)
    tail = registry.get(req.rid)
    assert tail is not None and env.backend.binder.cuts == [cut]
    assert sum(f"read in layer groups {cut}" in r.getMessage() for r in caplog.records) == 1  # a new cut: said
    ((bounds, read_s, compute_s, n, ranges),) = asked
    assert (bounds, n, ranges) == (pages.plan.bounds, env.backend.binder.streams[0].pages, 2)
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
    costs = env.backend.stream_costs
    for n in (1, 2):  # 1 s of forward over the model per MB of tail: never worth it
        costs.record_stream_forward(n * 1_000_000, [(8, 8)], 8e-3 + n * 1.0)
    reason = "predicted no faster: loaded whole"
    before = stream_admit.STATS.not_registered[reason]
    req = new_req("r-whole")
    registry = registered(env, req, head=3)
    assert env.backend.binder.streams == [] and len(registry) == 0
    assert stream_admit.STATS.not_registered[reason] == before + 1
    assert costs.snapshot().whole_samples == 1  # the load from its op's start to its handled result
    assert costs.timing(req.rid) is BindVerdict.WHOLE  # and its request is timed on to its first token
    admit(env, req)
    assert req.prefix_len == N_TOKENS and req.host_hit_length == N_TOKENS  # the whole hit, from L3 via L2
