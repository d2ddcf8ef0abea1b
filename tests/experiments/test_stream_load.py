"""The forward side of a streamed tail: start, per-layer gate, zero-fill, verdict.

Driven through SGLang's real classes on the CPU: a ``UnifiedRadixCache`` with HiCache from SGLang's own kit
(``HybridCacheController``, MHA device pool, ``layer_first`` host pool, ``direct`` IO), its real layer
counter registered with the device pool, the real ``ready_to_load_host_cache`` (``start_loading``) under
our AROUND hook, and the device pool's own attention read path (``get_key_buffer`` / ``get_value_buffer``
-> ``LayerDoneCounter.wait_until``) under our gate. The tail's stream is a test double of the
``TailStream`` protocol whose groups land when the test says so (``threading.Event``).

No test sleeps to synchronise: a parked reader is known through the gate's ``on_block`` hook
(``stream_copy.ON_BLOCK``). Timeouts only bound failures; the one deadline exercised on purpose (a
stalled group) is made short.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from thread_kit import BOUND_S, Parked, finished, start  # noqa: E402

from sgl_kvtier.experiments.layer_loader import plugin as layer_loader  # noqa: E402
from sgl_kvtier.experiments.streaming import plugin as stream  # noqa: E402
from sgl_kvtier.experiments.streaming.contract import GroupVerdict, StreamedTail, TailState  # noqa: E402
from sgl_kvtier.experiments.streaming.hooks import bind as stream_bind  # noqa: E402
from sgl_kvtier.experiments.streaming.hooks import copy as stream_copy
from sgl_kvtier.experiments.streaming.hooks import core as stream_core
from sgl_kvtier.experiments.streaming.hooks import load as stream_load
from sgl_kvtier.experiments.streaming.hooks import retract as stream_retract

if torch.cuda.is_available():  # pragma: no cover - the loader thread is the CPU route
    pytest.skip("CPU route: CPU pools and the torch.cpu device module", allow_module_level=True)

PS, LAYERS, HEADS, DIM = 16, 6, 2, 8
GROUPS = [range(0, 2), range(2, 4), range(4, 6)]
PAGES = 2
TOKENS = PS * PAGES


class FakeStream:
    """A ``TailStream`` whose groups land (or fail) when the test releases them; records every wait."""

    def __init__(self, host_indices: torch.Tensor, groups: list[range] = GROUPS) -> None:
        self._groups = groups
        self._host = host_indices
        self.released = [threading.Event() for _ in groups]
        self.verdicts = [GroupVerdict.LANDED for _ in groups]
        self.waits: list[tuple[int, int, float | None]] = []
        self.cancelled = False

    pages = PAGES

    @property
    def groups(self) -> int:
        return len(self._groups)

    @property
    def host_indices(self) -> torch.Tensor:
        return self._host

    def layers(self, group: int) -> range:
        return self._groups[group]

    def release(self, group: int, verdict: GroupVerdict = GroupVerdict.LANDED) -> None:
        self.verdicts[group] = verdict
        self.released[group].set()

    def wait_group(self, group: int, first_page: int, timeout: float | None) -> GroupVerdict:
        self.waits.append((group, first_page, timeout))
        if self.released[group].wait(BOUND_S if timeout is None else timeout):
            return self.verdicts[group]
        return GroupVerdict.TIMEOUT

    def landed_pages(self) -> int:
        return 0

    def remaining_bytes(self, first_page: int) -> int:
        return 0

    def read_rate(self) -> float | None:
        return None

    def rate_settled(self) -> bool:
        return True

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def ended(self) -> bool:
        return self.cancelled or all(e.is_set() for e in self.released)

    def wait_ended(self, timeout: float | None = None) -> bool:
        return self.ended


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def kit_cache():
    """One real UnifiedRadixCache with HiCache (no L3) for the module: SGLang's kit, on the CPU."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang.test.kits.unified_radix_cache import fixtures as kit
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    from sgl_kvtier.sglang.plugins import cpu as cpu_plugin

    mp = pytest.MonkeyPatch()
    mp.setenv(cpu_plugin.ENV_FLAG, "1")
    cpu_plugin.load()
    HookRegistry.apply_hooks()
    mp.setattr(kit, "get_device", lambda *a, **k: "cpu")
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        cfg = CacheConfig(page_size=PS, num_layers=LAYERS, head_num=HEADS, head_dim=DIM, dtype=torch.float32,
                          kv_size=1024, max_context_len=1024)
        cache, allocator, _ = kit.build_fixture(cfg)
        args = ServerArgs(model_path="dummy", page_size=PS, hicache_io_backend="direct",
                          hicache_mem_layout="layer_first", hicache_write_policy="write_through", hicache_ratio=2.0)
        set_global_server_args_for_scheduler(args)
        cache.init_hicache(args, cache.cache_init_params)
        kit.drop_hicache_atexit_pin(cache)
        yield SimpleNamespace(cache=cache, allocator=allocator, cc=cache.cache_controller,
                              host=cache.cache_controller.mem_pool_host.anchor_entry.host_pool,
                              device=cache.cache_controller.mem_pool_device)
    mp.undo()


@pytest.fixture
def env(kit_cache, monkeypatch):
    """``kit_cache`` with streaming on for it, our gate on the layer counter, fresh counters; a tail's
    host and device slots come from the real pools and go back after the test."""
    from sglang.srt.managers.cache_controller import LayerDoneCounter

    k = kit_cache
    monkeypatch.setattr(stream_core, "active", lambda cache: stream.registry_of(cache))
    monkeypatch.setattr(stream_copy, "STATS", stream_copy.StreamLoadStats())
    monkeypatch.setattr(stream_copy, "SLOW_IO_S", BOUND_S)  # no deadline passes unless a test shortens it
    parked = Parked()
    monkeypatch.setattr(stream_copy, "ON_BLOCK", parked)
    monkeypatch.delenv(stream_copy.ENV_FAULT, raising=False)
    sglang_wait = LayerDoneCounter.wait_until

    def gated(counter, threshold):  # both gates, as two AROUND hooks compose: ours around layer_loader's
        return stream_load.wait_until(lambda c, t: layer_loader.wait_until(sglang_wait, c, t), counter, threshold)

    monkeypatch.setattr(LayerDoneCounter, "wait_until", gated)
    k.cache.__dict__.pop(stream.REGISTRY_ATTR, None)
    host_before, dev_before = k.host.available_size(), k.allocator.available_size()
    held: list[tuple[torch.Tensor, torch.Tensor]] = []

    def new_tail(rid: str, groups: list[range] = GROUPS, seed: int = 1) -> tuple[StreamedTail, FakeStream]:
        host_idx, dev_idx = k.host.alloc(TOKENS), k.allocator.alloc(TOKENS)
        assert host_idx is not None and dev_idx is not None
        held.append((host_idx, dev_idx))
        g = torch.Generator().manual_seed(seed)
        for layer in range(LAYERS):
            for buf in (k.host.k_buffer[layer], k.host.v_buffer[layer]):
                buf[host_idx] = torch.randn(buf[host_idx].shape, generator=g)
            for buf in (k.device.k_buffer[layer], k.device.v_buffer[layer]):
                buf[dev_idx] = 7.0  # not zeros, not the host bytes: any write is visible
        fake = FakeStream(host_idx, groups)
        tail = StreamedTail(rid=rid, stream=fake, first_page=0, token_start=PS, tokens=TOKENS,
                            host_indices=host_idx, hashes=tuple(f"h{i}" for i in range(PAGES)),
                            device_indices=dev_idx)
        registry = stream.registry_of(k.cache)
        registry.register(tail)
        registry.queue_load(tail)
        return tail, fake

    yield SimpleNamespace(k=k, parked=parked, new_tail=new_tail, registry=lambda: stream.registry_of(k.cache))
    for load in stream_load.IN_FLIGHT.take(k.cache):
        load.join()
    k.cc.layer_done_counter.set_consumer(-1)
    for host_idx, dev_idx in held:
        k.host.free(host_idx)
        k.allocator.free(dev_idx)
    assert (k.host.available_size(), k.allocator.available_size()) == (host_before, dev_before)
    assert not stream_load.IN_FLIGHT, "a load left in flight"


def begin(e) -> int:
    """The batch's ``ready_to_load_host_cache`` (SGLang's, through our AROUND hook); the forward then
    consumes the index it returns (``tp_worker.set_hicache_consumer``)."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    p = stream_load.ready_to_load_host_cache(UnifiedRadixCache.ready_to_load_host_cache, e.k.cache)
    e.k.cc.layer_done_counter.set_consumer(p)
    return p


def layer_is(e, tail: StreamedTail, layer: int, what: str) -> bool:
    dev, host = e.k.device, e.k.host
    rows_d, rows_h = tail.device_indices, tail.host_indices
    for d, h in ((dev.k_buffer[layer], host.k_buffer[layer]), (dev.v_buffer[layer], host.v_buffer[layer])):
        want = h[rows_h] if what == "host" else torch.zeros_like(d[rows_d])
        if not torch.equal(d[rows_d], want):
            return False
    return True


def batch_of(*rids: str):
    """The batch that ran (its request order) and the scheduler around the kit's cache."""
    return [SimpleNamespace(rid=r) for r in rids]


# ---------------------------------------------------------------------------------------------- the gate
def test_a_held_group_blocks_exactly_the_readers_of_its_layers(env) -> None:
    tail, fake = env.new_tail("r1")
    p = begin(env)
    assert p >= 0 and tail.state is TailState.LOADING  # a producer of ours: no load-back of SGLang's here
    device = env.k.device
    t_key, out_key = start(device.get_key_buffer, 0)  # SGLang's attention read path, layer 0
    env.parked.wait_layer(0)
    assert t_key.is_alive() and not layer_is(env, tail, 0, "host")  # group 0 has not landed: nothing copied
    fake.release(0)
    assert finished(t_key) and isinstance(out_key[0], torch.Tensor)
    device.get_value_buffer(1)
    assert layer_is(env, tail, 0, "host") and layer_is(env, tail, 1, "host")
    t2, _ = start(device.get_key_buffer, 2)
    t5, _ = start(device.get_value_buffer, 5)
    env.parked.wait_layer(2)
    env.parked.wait_layer(5)
    assert not layer_is(env, tail, 2, "host") and not layer_is(env, tail, 4, "host")
    fake.release(1)  # group 1 releases the reader of layer 2 only
    assert finished(t2)
    device.get_key_buffer(3)  # the rest of group 1 (a read: it waits for the copy)
    assert layer_is(env, tail, 2, "host") and layer_is(env, tail, 3, "host")
    assert t5.is_alive() and not layer_is(env, tail, 4, "host")
    fake.release(2)
    assert finished(t5)
    assert all(layer_is(env, tail, layer, "host") for layer in range(LAYERS))  # the bytes are the host's
    # Per group, in order: a look (timeout 0: landed already?), then one wait (it had not).
    assert [w[:2] for w in fake.waits] == [(0, 0), (0, 0), (1, 0), (1, 0), (2, 0), (2, 0)]
    assert [w[2] == 0.0 for w in fake.waits] == [True, False] * 3
    s = stream_copy.stats()
    assert s["layers_copied"] == LAYERS and s["layers_zeroed"] == 0 and s["failed_groups"] == 0


def test_sglangs_own_load_back_keeps_its_producer(env, monkeypatch) -> None:
    """With a HiCache load-back in the same batch, ``start_loading`` took the producer: the tail rides on
    it (no second producer) and both land before the reads. The load-back is timed: the bind rule's X."""
    samples: list[tuple[object, int, float]] = []
    monkeypatch.setattr(stream_bind, "sample_load_back", lambda cache, tokens, s: samples.append((cache, tokens, s)))
    k = env.k
    counter = k.cc.layer_done_counter
    host_idx = k.host.alloc(PS)
    k.host.k_buffer[0][host_idx] = 3.0
    dev_idx = k.cc.load(host_idx)  # SGLang's own load-back op (device slots allocated by the controller)
    assert dev_idx is not None
    tail, fake = env.new_tail("r1")
    for g in range(len(GROUPS)):
        fake.release(g)
    before = counter.producer_index
    p = begin(env)
    assert p == counter.producer_index == (before + 1) % counter.num_counters  # one producer, SGLang's
    assert len(samples) == 1 and samples[0][:2] == (k.cache, PS) and samples[0][2] >= 0  # its one op, timed
    k.device.get_key_buffer(LAYERS - 1)
    assert torch.equal(k.device.k_buffer[0][dev_idx], k.host.k_buffer[0][host_idx])
    assert all(layer_is(env, tail, layer, "host") for layer in range(LAYERS))
    stream_load.after_run_batch(None, SimpleNamespace(tree_cache=k.cache), SimpleNamespace(reqs=batch_of("r1")))
    k.cc.ack_load_queue.clear()
    k.host.free(host_idx)
    k.allocator.free(dev_idx)


def test_inactive_is_a_pass_through(env, monkeypatch) -> None:
    tail, _ = env.new_tail("r1")
    monkeypatch.setattr(stream_core, "active", lambda cache: None)
    assert begin(env) == -1  # SGLang's answer: nothing to load
    assert tail.state is TailState.ADMITTED and not stream_load.IN_FLIGHT  # not taken, nothing started
    env.k.device.get_key_buffer(0)  # the gate passes straight to SGLang
    assert env.parked.layers == []
    env.registry().take_queued()


# ---------------------------------------------------------------------------------------------- failures
@pytest.mark.parametrize("how", ["failed", "timeout", "fault_knob"])
def test_a_failed_group_is_zeros_in_exactly_its_layers(env, monkeypatch, how) -> None:
    if how == "timeout":
        # the deadline of a stalled device, made short (yet long enough that the loader, on a loaded machine,
        # still reaches group 1 before it passed: the wait it records is then a real one)
        monkeypatch.setattr(stream_copy, "SLOW_IO_S", 1.0)
    if how == "fault_knob":
        monkeypatch.setenv(stream_copy.ENV_FAULT, "all:1")  # testing knob: group 1 of every tail FAILED
    tail, fake = env.new_tail("r1")
    other, other_fake = env.new_tail("r2", seed=2)
    fake.release(0)
    if how == "failed":
        fake.release(1, GroupVerdict.FAILED)
    elif how == "fault_knob":
        fake.release(1)  # it landed, but the knob says FAILED
    fake.release(2)
    for g in range(len(GROUPS)):
        other_fake.release(g)
    begin(env)
    env.k.device.get_value_buffer(LAYERS - 1)  # the forward reads the last layer: every layer is done
    for layer in range(LAYERS):
        assert layer_is(env, tail, layer, "zeros" if layer in GROUPS[1] else "host"), layer
    knob = how == "fault_knob"
    assert all(layer_is(env, other, layer, "zeros" if knob and layer in GROUPS[1] else "host")
               for layer in range(LAYERS))  # the batch's other tail: untouched by the failure (unless knobbed)
    # The loader records the failure; the state changes on the scheduler thread only, at the verdict.
    assert tail.state is TailState.LOADING and tail.failed_groups == [1] and other.failed_groups == ([1] if knob else [])
    if how == "timeout":
        (g, _, timeout), = [w for w in fake.waits if w[0] == 1 and w[2]]  # the look had timeout 0
        assert 0 < timeout <= 1.0  # waited at most the tail's deadline
        assert stream_copy.stats()["timeouts"] == 1
    if knob:
        assert [w[0] for w in fake.waits] == [0, 2]  # the failed group was never waited for
    assert stream_copy.stats()["layers_zeroed"] == len(GROUPS[1]) * (2 if knob else 1)


def test_a_tail_that_cannot_be_prepared_is_poisoned_without_waiting(env, monkeypatch) -> None:
    tail, fake = env.new_tail("r1", groups=[range(0, 3), range(2, 6)])  # layer 2 in two groups
    begin(env)
    env.k.device.get_key_buffer(LAYERS - 1)
    assert fake.waits == [] and all(layer_is(env, tail, layer, "zeros") for layer in range(LAYERS))
    assert stream_copy.BOUNDARY.counts().expected + stream_copy.BOUNDARY.counts().unexpected >= 1
    assert run_verdict(env, monkeypatch, ["r1"]) == ["r1"] and tail.state is TailState.POISONED
    env.registry().reap()


# ---------------------------------------------------------------------------------------------- verdict
def run_verdict(env, monkeypatch, rids, remote_min=None):
    """AFTER ``run_batch`` for a batch of ``rids``; ``remote_min``: what another rank's MIN makes of the
    flags. Returns the requests the verdict asked to retract."""
    retracted: list[str] = []
    monkeypatch.setattr(stream_retract, "retract_or_abort",
                        lambda scheduler, batch, req, *, reason: retracted.append(req.rid) or True)
    if remote_min is not None:
        monkeypatch.setattr(env.k.cache, "_all_reduce", lambda t, op: t.copy_(torch.minimum(t, remote_min)))
    stream_load.after_run_batch(None, SimpleNamespace(tree_cache=env.k.cache), SimpleNamespace(reqs=batch_of(*rids)))
    return retracted


def test_verdict_landed_tails_are_done_and_their_slots_deferred(env, monkeypatch) -> None:
    tails = [env.new_tail(f"r{i}", seed=i) for i in (1, 2)]
    for _, fake in tails:
        for g in range(len(GROUPS)):
            fake.release(g)
    begin(env)
    retracted = run_verdict(env, monkeypatch, ["x", "r2", "r1"])
    reg = env.registry()
    assert retracted == [] and not stream_load.IN_FLIGHT  # joined
    assert all(t.state is TailState.DONE and reg.get(t.rid) is None for t, _ in tails)
    assert reg.deferred() == 2 and [len(s) for s in reg.reap()] == [TOKENS, TOKENS]
    assert stream_copy.stats()["landed"] == 2 and not reg.is_blocked("r1")


def test_verdict_retracts_a_tail_poisoned_on_any_rank(env, monkeypatch) -> None:
    (t1, f1), (t2, f2) = env.new_tail("r1"), env.new_tail("r2", seed=2)
    for g in range(len(GROUPS)):
        f1.release(g)
        f2.release(g, GroupVerdict.FAILED if g == 2 else GroupVerdict.LANDED)
    begin(env)
    # The batch's order is r2, r1: another rank failed r1 (its flag 0 there), this rank failed r2.
    retracted = run_verdict(env, monkeypatch, ["r2", "r1"], remote_min=torch.tensor([1, 0], dtype=torch.int32))
    reg = env.registry()
    assert retracted == ["r2", "r1"]
    assert t1.state is t2.state is TailState.POISONED and t2.failed_groups == [2] and t1.failed_groups == []
    assert f1.cancelled and f2.cancelled and reg.is_blocked("r1") and reg.is_blocked("r2")
    assert reg.get("r1") is None and reg.get("r2") is None and reg.deferred() == 2
    reg.reap()
    assert stream_copy.stats()["poisoned"] == 2


def test_hooks_target_sglang_methods() -> None:
    import importlib

    specs = stream_load.HOOKS
    assert {kind for _, _, kind in specs} <= {"AROUND", "AFTER", "BEFORE"}
    for target, fn, _ in specs:
        module_path, cls_name, attr = target.rsplit(".", 2)
        assert callable(getattr(getattr(importlib.import_module(module_path), cls_name), attr)), target
        assert callable(fn)
    assert all(spec in stream.hook_specs() for spec in specs)
    # The verdict runs before the retract knob (AFTER hooks apply in registration order).
    run_batch = [fn for target, fn, _ in specs if target.endswith("Scheduler.run_batch")]
    assert run_batch == [stream_load.after_run_batch, stream_retract.knob_retract_after]
