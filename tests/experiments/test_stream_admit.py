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

The gate's and the bind rule's decisions are ``test_stream_admit_gate``'s, on the same harness.

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

from sgl_kvtier.experiments.streaming import plugin as stream  # noqa: E402
from sgl_kvtier.experiments.streaming.backend_side import require_side
from sgl_kvtier.experiments.streaming.contract import TailState  # noqa: E402
from sgl_kvtier.experiments.streaming.hooks import admit as stream_admit  # noqa: E402
from sgl_kvtier.experiments.streaming.hooks import bind as stream_bind
from sgl_kvtier.experiments.streaming.hooks import core as stream_core
from sgl_kvtier.experiments.streaming.hooks import slots as stream_slots
from sgl_kvtier.experiments.streaming.rules.bind import BindVerdict  # noqa: E402

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
    assert require_side(env.backend).stream_costs.timing(req.rid) is BindVerdict.STREAM  # the rule's choice, timed to its token
    assert (tail.first_page, tail.token_start, tail.tokens) == (3, 3 * PS, (N_PAGES - 3) * PS)
    stream_ = tail.stream
    assert torch.equal(tail.host_indices, stream_.host_indices[3 * PS:])
    assert require_side(env.backend).binder.claims == []  # SGLang released none of the tail's slots: all withheld
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
    [stream_] = require_side(env.backend).binder.streams
    assert stream_.cancelled and registry.deferred() == 1  # taken by this rank: its tail slots are ours to free
    assert require_side(env.backend).binder.claims == [] and env.host.available_size() == env.host_baseline - N_TOKENS
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
    assert require_side(env.backend).binder.streams == [] and len(registry) == 0 and registry.deferred() == 0
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
        assert require_side(env.backend).binder.bound_pages() == 0 and len(stream.registry_of(env.cache)) == 0
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
    assert require_side(env.backend).binder.streams == [] and len(stream.active(env.cache)) == 0
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
    require_side(env.backend).bind_hit(hashes, slots)  # bound, as after allocate_storage_hit
    [stream_] = require_side(env.backend).binder.streams
    env.cc.free_prefetch_host_buffers(SimpleNamespace(pool_transfers=None), slots)  # SGLang's direct rollback
    assert stream_.cancelled and registry.deferred() == 1
    assert env.host.available_size() == env.host_baseline - 2 * PS  # not freed under the stream's reads
    stream_.finish()
    reap_all(env, registry)
    assert env.host.available_size() == env.host_baseline


def test_an_early_cut_streams_nothing(consumer):
    env, req = consumer, new_req("r-early")
    env.cache.prefetch_stop_policy = "best_effort"  # cut at the first admission poll, IO maybe still running
    require_side(env.backend).binder.head = 2
    arrive(env, req)
    handle = req.cache_request_handle
    env.queues.pump(env.cache, lambda: env.cache.ongoing_prefetch[handle].host_indices is not None,
                    "the hit's host slots")
    op = env.cache.ongoing_prefetch[handle].operation
    assert len(require_side(env.backend).binder.streams) == 1  # bound at allocation
    assert env.cache.check_prefetch_progress(handle) is True  # SGLang's cut; our register stays out of it
    registry = stream.active(env.cache)
    assert len(registry) == 0 and op.ack_releases_incomplete_host_indices  # SGLang releases the rest itself
    env.queues.pump(env.cache, lambda: bool(require_side(env.backend).binder.claims), "the op's last ack")
    [(stream_, held)] = require_side(env.backend).binder.claims  # its unfinished pages: withheld until the stream ended
    assert stream_.cancelled and registry.deferred() == 1 and torch.equal(held, stream_.host_indices[2 * PS:])
    stream_.finish()
    reap_all(env, registry)
    assert env.host.available_size() == env.host_baseline - op.completed_tokens  # the cut's head, in the tree
