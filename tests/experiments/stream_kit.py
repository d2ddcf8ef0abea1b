r"""Test doubles and helpers for the streamed-tail admission tests (``test_stream_admit``).

``StreamingTestStorage`` is our real ``KVTierStorage`` (store, read path, cost policy) whose streaming side
(``FakeSide``: ``bind_hit`` / ``binder``) is a test double: ``FakeBinder`` (``binding.StreamBinder``'s interface) of ``FakeStream``\ s
(``contract.TailStream`` with controllable groups). The head pages a stream answers True to SGLang's IO
thread are read from the real store into their slots first; landing a group of the tail reads the tail
pages' real bytes into their withheld slots. An IO in flight is simulated: a cancelled stream ends only
when the test says so (``finish``, ``end_when_cancelled``). SGLang's cache is built by its own unit kit
with ``hicache`` (the dynamic backend factory loads ``StreamingTestStorage`` from this module by name).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import PrefillAdder
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from sgl_kvtier.experiments.streaming import plugin as stream
from sgl_kvtier.experiments.streaming.backend_side import StreamingSide, require_side
from sgl_kvtier.experiments.streaming.binding import StreamCounters
from sgl_kvtier.experiments.streaming.contract import GroupVerdict
from sgl_kvtier.sglang import KVTierStorage

PS, LAYERS, HEADS, HEAD_DIM = 16, 2, 2, 64
DTYPE = torch.bfloat16
N_PAGES = 8
N_TOKENS = N_PAGES * PS
SUFFIX = 5  # prompt tokens after the stored span (the last one is never a prefix)
DEADLINE_S = 30.0


# ---------------------------------------------------------------------------------------------- test doubles
class FakeStream:
    """``contract.TailStream`` with controllable groups: ``land(g)``, ``fail(g)``, ``finish()`` (IO ends)."""

    def __init__(self, backend: StreamingTestStorage, hashes: list[str], host_indices: torch.Tensor, head: int):
        self.backend, self.hashes, self._slots, self.head = backend, hashes, host_indices, head
        self._cond = threading.Condition()
        self.landed_groups = 0  # groups landed on every page past the head
        self.failed_group: int | None = None
        self.cancelled = False
        self._ended = False
        self._read = False
        self.rate: float | None = None  # bytes/s (None: not measured yet)
        self.rate_is_settled = True  # ``rate`` counted between landings (False: from the thread's start)

    pages = property(lambda self: len(self.hashes))
    groups = property(lambda self: LAYERS)  # one layer per group
    host_indices = property(lambda self: self._slots)

    def layers(self, group: int) -> range:
        return range(group, group + 1)

    def landed_pages(self) -> int:
        with self._cond:
            return self.pages if self.landed_groups == self.groups else self.head

    def wait_group(self, group: int, first_page: int, timeout: float | None) -> GroupVerdict:
        def decided() -> GroupVerdict | None:
            if first_page >= self.pages or group < self.landed_groups:
                return GroupVerdict.LANDED
            if self.failed_group is not None and self.failed_group <= group:
                return GroupVerdict.FAILED
            return None

        with self._cond:
            self._cond.wait_for(lambda: decided() is not None, timeout)
            return decided() or GroupVerdict.TIMEOUT

    def remaining_bytes(self, first_page: int) -> int:
        with self._cond:
            if self.failed_group is not None:
                return 0
            return (self.pages - max(first_page, self.head)) * (self.groups - self.landed_groups) * self.backend.group_bytes

    def read_rate(self) -> float | None:
        return self.rate

    def rate_settled(self) -> bool:
        return self.rate_is_settled

    def cancel(self) -> None:
        with self._cond:
            self.cancelled = True
            if self.landed_groups < self.groups and self.failed_group is None:
                self.failed_group = self.landed_groups
            self._cond.notify_all()

    @property
    def ended(self) -> bool:
        with self._cond:
            return self._ended

    def wait_ended(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._ended, timeout)

    # test controls
    def land(self, group: int) -> None:
        if not self._read:  # the tail pages' real bytes, read into their (withheld) slots
            tail = slice(self.head * PS, self.pages * PS)
            assert all(self.backend.real_get(self.hashes[self.head:], self._slots[tail]))
            self._read = True
        with self._cond:
            self.landed_groups = max(self.landed_groups, group + 1)
            self._cond.notify_all()

    def fail(self, group: int) -> None:
        with self._cond:
            self.failed_group = group
            self._cond.notify_all()

    def end_when_cancelled(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.cancelled, DEADLINE_S)
        self.finish()

    def finish(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def settled(self, page: int) -> bool:
        return self._ended or page < self.head


class FakeBinder:
    """The backend's table of bound hits (``binding.StreamBinder``'s interface) over ``FakeStream``\\ s."""

    def __init__(self, backend: StreamingTestStorage):
        self.backend = backend
        self.head = 0  # pages each new stream has landed when SGLang's IO thread asks
        self.streams: list[FakeStream] = []
        self._index: dict[int, tuple[FakeStream, int]] = {}  # host page -> (stream, page in it)
        self._lock = threading.Lock()
        self.claims: list[tuple[FakeStream, torch.Tensor]] = []
        self.cuts: list[tuple[int, ...] | None] = []  # what each bind was asked for (``experiments.streaming.rules.read_groups``)

    def bind(self, hashes: list[str], host_indices: torch.Tensor, cuts: tuple[int, ...] | None = None) -> FakeStream:
        self.cuts.append(cuts)
        stream = FakeStream(self.backend, hashes, host_indices, min(self.head, len(hashes)))
        with self._lock:
            self.streams.append(stream)
            for i, hp in enumerate((host_indices[::PS] // PS).tolist()):
                self._index[hp] = (stream, i)
        return stream

    def bound_pages(self) -> int:
        with self._lock:
            return len(self._index)

    def answer(self, keys, host_indices):  # the real batch_get_v1's question: never ours (see the subclass)
        return None

    def head_answer(self, hashes: list[str], host_indices: torch.Tensor) -> list[bool] | None:
        with self._lock:
            found = self._index.get(int(host_indices[0]) // PS)
        if found is None:
            return None
        stream, offset = found
        heads = max(0, min(len(hashes), stream.head - offset))
        if heads:
            assert all(self.backend.real_get(hashes[:heads], host_indices[:heads * PS]))
        return [True] * heads + [False] * (len(hashes) - heads)

    def take(self, host_indices: torch.Tensor) -> FakeStream | None:
        with self._lock:
            found = self._index.get(int(host_indices[0]) // PS)
            if found is None:
                return None
            for hp in [hp for hp, (s, _) in self._index.items() if s is found[0]]:
                del self._index[hp]
            return found[0]

    def claim_released(self, host_indices: torch.Tensor):
        pages = host_indices // PS
        held: dict[int, tuple[FakeStream, list[int]]] = {}
        with self._lock:
            for hp in torch.unique(pages).tolist():
                found = self._index.pop(hp, None)
                if found is not None and not found[0].settled(found[1]):
                    held.setdefault(id(found[0]), (found[0], []))[1].append(hp)
        keep = torch.ones(host_indices.numel(), dtype=torch.bool)
        out = []
        for s, hps in held.values():
            s.cancel()
            mask = torch.isin(pages, torch.tensor(hps, dtype=pages.dtype))
            keep &= ~mask
            out.append((s, host_indices[mask]))
        self.claims.extend(out)
        return host_indices[keep], out

    def counts(self) -> StreamCounters:  # the backend's telemetry reads it: no real stream, nothing counted
        return StreamCounters()

    def close(self) -> None:
        for s in self.streams:
            s.cancel()
            s.finish()


class FakeSide(StreamingSide):
    """The backend's streaming side with the test-double binder: it always streams and binds raw hashes."""

    def __init__(self, backend: StreamingTestStorage):
        super().__init__(backend)
        self.binder.close()  # the real binder is never used here
        self.binder = FakeBinder(backend)  # type: ignore[assignment]

    @property
    def enabled(self) -> bool:
        return True

    def bind_hit(self, hashes, host_indices, cuts=None):
        self.binder.bind(list(hashes), host_indices, cuts)


class StreamingTestStorage(KVTierStorage):
    """Our real backend (store, read path, cost policy) with a test-double streaming side (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extensions = (FakeSide(self),)
        self.binder = require_side(self).binder
        self.group_bytes = PS * HEADS * HEAD_DIM * DTYPE.itemsize * 2  # K and V of one layer of one page

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        """SGLang's IO thread: bound slots get the stream's head answer at once, others a real read."""
        answer = self.binder.head_answer(list(keys), host_indices)
        return answer if answer is not None else super().batch_get_v1(keys, host_indices, extra_info)

    def real_get(self, hashes: list[str], host_indices: torch.Tensor) -> list[bool]:
        """A real read from the store into ``host_indices`` (our backend's own ``batch_get_v1``)."""
        return list(super().batch_get_v1(list(hashes), host_indices))


# ---------------------------------------------------------------------------------------------- helpers
def token_ids(n: int, seed: str) -> list[int]:
    out, h = [], seed.encode()
    while len(out) < n:
        h = hashlib.sha256(h).digest()
        out.extend(int.from_bytes(h[i:i + 2], "little") % 30000 for i in range(0, 32, 2))
    return out[:n]


TOKENS = token_ids(N_TOKENS + SUFFIX, "stream-admit")


def hicache(kit, store_dir, caches: list, backend: str = "StreamingTestStorage", **extra):
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    cfg = CacheConfig(page_size=PS, num_layers=LAYERS, head_num=HEADS, head_dim=HEAD_DIM, dtype=DTYPE,
                      kv_size=1024, max_context_len=1024)
    cache, allocator, req_pool = kit.build_fixture(cfg)
    module = "sgl_kvtier.sglang" if backend == "KVTierStorage" else __name__  # "stream_kit"
    config = {"backend_name": "kvtier", "module_path": module, "class_name": backend, "interface_v1": 1,
              "devices": [str(store_dir)], "capacity_bytes": 64 << 20, "prefetch_threshold": PS, **extra}
    args = ServerArgs(model_path="dummy", page_size=PS, hicache_io_backend="direct", hicache_mem_layout="layer_first",
                      hicache_write_policy="write_through", hicache_storage_backend="dynamic",
                      hicache_storage_backend_extra_config=json.dumps(config),
                      hicache_storage_prefetch_policy="wait_complete")
    set_global_server_args_for_scheduler(args)
    cache.init_hicache(args, cache.cache_init_params)
    kit.drop_hicache_atexit_pin(cache)
    caches.append(cache)
    return SimpleNamespace(cache=cache, alloc=allocator, req_pool=req_pool, cc=cache.cache_controller,
                           backend=cache.cache_controller.storage_backend,
                           host=cache.cache_controller.mem_pool_host.get_entry(PoolName.KV).host_pool)


def kv_buffers(allocator) -> list[torch.Tensor]:
    pool = allocator.get_kvcache()
    return [pool.get_key_buffer(i) for i in range(pool.layer_num)] + [pool.get_value_buffer(i) for i in range(pool.layer_num)]


class Queues:
    """Wakes the test when the controller's threads put a hit or an ack (no sleeps)."""

    def __init__(self, cc, monkeypatch):
        self.event = threading.Event()
        for q in (cc.prefetch_hit_queue, cc.ack_prefetch_queue, cc.ack_backup_queue):
            real = q.put

            def put(item, *a, _real=real, **k):
                _real(item, *a, **k)
                self.event.set()

            monkeypatch.setattr(q, "put", put)

    def pump(self, cache, cond, what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            self.event.clear()
            cache.check_hicache_events()
            if cond():
                return
            if not self.event.wait(max(0.0, deadline - time.monotonic())):
                pytest.fail(f"timed out waiting for {what}")


def store_prompt(kit, store_dir, monkeypatch) -> SimpleNamespace:
    """The prompt's first ``N_PAGES`` pages in our L3 store, and their KV bytes per token row."""
    caches: list = []
    try:
        prod = hicache(kit, store_dir, caches, backend="KVTierStorage")
        value = prod.alloc.alloc(N_TOKENS)
        g = torch.Generator().manual_seed(7)
        for buf in kv_buffers(prod.alloc):
            raw = buf.view(torch.uint8)
            raw[value] = torch.randint(0, 256, (len(value), *raw.shape[1:]), dtype=torch.uint8, generator=g)
        original = [b.view(torch.uint8)[value].clone() for b in kv_buffers(prod.alloc)]
        prod.cache.insert(InsertParams(key=RadixKey(array("q", TOKENS[:N_TOKENS])), value=value))
        leaf = kit.match_prefix(prod.cache, TOKENS[:N_TOKENS]).last_device_node
        Queues(prod.cc, monkeypatch).pump(prod.cache, lambda: prod.cache.tree_core.is_backuped(leaf) and not (
            prod.cache.ongoing_write_through or prod.cache.ongoing_backup), "the write-through L3 backup")
        ok, msg = prod.cache.detach_storage_backend()
        assert ok, msg
    finally:
        for c in caches:
            c.release_host_resources()
    return SimpleNamespace(dir=store_dir, original=original)


def open_consumer(kit, stored: SimpleNamespace, monkeypatch, caches: list) -> SimpleNamespace:
    """A fresh cache with the streaming test backend on ``stored``'s store, and its slot baselines."""
    env = hicache(kit, stored.dir, caches)
    env.queues = Queues(env.cc, monkeypatch)
    env.original, env.kit = stored.original, kit
    env.host_baseline = env.host.available_size()
    env.device_baseline = env.alloc.available_size()
    return env


@contextmanager
def consumer_over_stored_prompt(kit, tmp_path, monkeypatch) -> Iterator[SimpleNamespace]:
    """A consumer cache (``open_consumer``) over a store holding the prompt; its caches closed after."""
    stored = store_prompt(kit, tmp_path, monkeypatch)
    caches: list = []
    try:
        yield open_consumer(kit, stored, monkeypatch, caches)
    finally:
        close_all(caches)


def close_all(caches: list) -> None:
    for c in caches:
        if c.cache_controller is not None and c.cache_controller.enable_storage:
            c.detach_storage_backend()
        c.release_host_resources()


def new_req(rid: str) -> Req:
    return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", TOKENS),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=1))


def arrive(env, req: Req, storage_hit_end: int | None = None) -> None:
    """SGLang's own arrival path: ``Scheduler._prefetch_kvcache`` (match, then ``prefetch_from_storage``); with
    ``storage_hit_end`` as its L3 retries call it (a hit end known: SGLang's op spans only the hit)."""
    Scheduler._prefetch_kvcache(SimpleNamespace(enable_hicache_storage=True, enable_lmcache=False,
                                                tree_cache=env.cache), req, storage_hit_end)


def registered(env, req: Req, head: int, storage_hit_end: int | None = None):
    """``req`` arrives with ``head`` pages of its hit landed when SGLang's IO thread asks; pumped until the
    prefetch result was handled (the tail registered, or not)."""
    require_side(env.backend).binder.head = head
    arrive(env, req, storage_hit_end)
    registry = stream.active(env.cache)
    assert registry is not None
    env.queues.pump(env.cache, lambda: req.rid not in {h.rid for h in env.cache.ongoing_prefetch},
                    "the prefetch result")
    return registry


def adder_for(env) -> PrefillAdder:
    return PrefillAdder(PS, env.cache, env.alloc, None, 0.5, rem_input_tokens=4096, rem_chunk_tokens=None)


def admit(env, req: Req, adder: PrefillAdder | None = None):
    """SGLang's admission order: the prefetch gate, the match, then ``add_one_req``."""
    if not env.cache.check_prefetch_progress(req.cache_request_handle):
        return None
    loaded, start = env.cache.pop_prefetch_loaded_span(req.cache_request_handle)
    if loaded > 0:  # what the scheduler does with the popped span (scheduler.py:4250-4256)
        req.storage_hit_length, req.storage_hit_start = loaded, start
    req.init_next_round_input(env.cache)
    adder = adder or adder_for(env)
    return adder, adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)


def tree_device_tokens(cache) -> int:
    return cache.evictable_size() + cache.protected_size()


def reap_all(env, registry) -> None:
    env.cache.check_hicache_events()
    assert registry.deferred() == 0
