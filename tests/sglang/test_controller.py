"""KVTierStorage driven by SGLang 0.5.23's REAL HiCache controllers, on the CPU, byte-exact.

Two tests, each the full trip device (L1) -> host (L2) -> our store (L3) -> host -> device:

1. ``test_hicache_controller_round_trip`` drives ``HiCacheController``
   (``sglang.srt.managers.cache_controller``) directly, with this test playing the scheduler thread:
   ``write`` + ``start_writing`` (D2H, ack on ``ack_write_queue``) -> ``write_storage`` -> the
   controller's backup thread calls our ``batch_set_v1`` in <=128-page batches (ack on
   ``ack_backup_queue``) -> ``evict_host`` and both KV pools wiped -> ``prefetch`` -> its prefetch
   thread calls our ``batch_exists`` (hit on ``prefetch_hit_queue``) -> host bounce allocated the way
   ``UnifiedRadixCache`` does it, op put on ``prefetch_buffer`` -> its IO thread calls our
   ``batch_get_v1`` (progress and completion acks on ``ack_prefetch_queue``) -> ``load`` +
   ``start_loading`` (H2D, ack on ``ack_load_queue``).
2. ``test_unified_radix_cache_round_trip_across_restart`` drives what a 0.5.23 server actually runs:
   ``UnifiedRadixCache.init_hicache`` -> ``HybridCacheController`` with the ``dynamic`` backend factory,
   pools built by SGLang's own unit kit (``sglang.test.kits.unified_radix_cache.fixtures``). An
   ``insert`` triggers write-through; ``check_hicache_events`` (the per-step scheduler poll) finishes
   the D2H ack, which queues the L3 backup. The backend is then detached (closed) and a fresh cache
   (new device and host pools, new controller, same directory) fetches the prompt back through
   ``prefetch_from_storage`` / ``check_prefetch_progress`` and ``load_back``. SGLang's real
   ``StorageMetricsCollector`` (bound to a private Prometheus registry) receives our ``get_stats()``
   every step.

Both wait only on the controllers' own acks and queues (blocking gets or polls under a deadline).

What the CPU needs (``sgl_kvtier.sglang.plugins.cpu_shims`` says why): ``io_backend="direct"`` with the
``layer_first`` host layout, and the sgl_kvtier CPU shims. They are installed in-process exactly as SGLang's plugin
loader would (``plugins.cpu.load()`` + ``HookRegistry.apply_hooks()``), which adds the torch
``transfer_kv_direct`` stand-in (``sgl_kernel`` is absent) and forces ``pin_memory=False`` on
``HostKVCache`` (the hybrid pool assembler hard-codes pinned memory). The kit's ``build_fixture``
asks ``get_device()``, which raises on a machine with neither an accelerator nor SGLang's CPU engine,
so it is pointed at "cpu" here. A single rank is forced with ``get_parallel().override`` as SGLang's
own kits do. On a CUDA machine the module is skipped: its pools are CPU pools, and the real kernels
are exercised by the server tests there.
"""

from __future__ import annotations

import functools
import hashlib
import json
import queue
import threading
import time
from array import array

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

if torch.cuda.is_available():  # pragma: no cover - GPU machines run the real kernels instead
    pytest.skip("CPU harness: builds CPU KV pools and uses the CPU shims", allow_module_level=True)

from pools import host_pool_over  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, InsertParams  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

from sgl_kvtier.admin.fsck import find_shards, fsck, shard_summary  # noqa: E402
from sgl_kvtier.sglang import KVTierStorage  # noqa: E402

PS = 16  # tokens per page
LAYERS, HEADS, HEAD_DIM = 2, 2, 64
DTYPE = torch.bfloat16
PAGE_BYTES = PS * LAYERS * 2 * HEADS * HEAD_DIM * DTYPE.itemsize  # K and V of every layer
DEADLINE_S = 30.0

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------------------------------- setup
def backend_extra(store_dir, **more) -> dict:
    return {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang", "class_name": "KVTierStorage",
            "interface_v1": 1, "devices": [str(store_dir)], "capacity_bytes": 64 << 20,
            "readahead_bytes": 64 << 20, **more}  # read-ahead on (off by default): its staging is counted here


def token_ids(n: int, seed: str) -> list[int]:
    out, h = [], seed.encode()
    while len(out) < n:
        h = hashlib.sha256(h).digest()
        out.extend(int.from_bytes(h[i:i + 2], "little") % 30000 for i in range(0, 32, 2))
    return out[:n]


def randomize(buffers, generator: torch.Generator, rows: torch.Tensor | None = None) -> None:
    """Random bytes (any bit pattern, NaNs included) in whole buffers or in some token rows."""
    for buf in buffers:
        raw = buf.view(torch.uint8)
        if rows is None:
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
        else:
            raw[rows] = torch.randint(0, 256, (len(rows), *raw.shape[1:]), dtype=torch.uint8, generator=generator)


def snapshot(buffers, rows: torch.Tensor) -> list[str]:
    """SHA-256 of the raw bytes of the given token rows, one digest per layer buffer (K..., V...)."""
    return [hashlib.sha256(buf.view(torch.uint8)[rows.cpu()].numpy().tobytes()).hexdigest() for buf in buffers]


def spy_on(backend: KVTierStorage, calls: list) -> None:
    """Record which controller thread calls which backend method (the methods still run)."""
    for name in ("batch_exists", "batch_get_v1", "batch_set_v1", "batch_get", "batch_set", "get_stats"):
        real = getattr(backend, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            result = _real(*args, **kwargs)
            n = len(args[0]) if args and isinstance(args[0], list) else None
            calls.append((_name, threading.current_thread().name, n, result))
            return result

        setattr(backend, name, wrapper)


def called(calls: list, method: str) -> list:
    return [c for c in calls if c[0] == method]


def get_before(q: queue.Queue, deadline: float, what: str):
    try:
        return q.get(timeout=max(0.01, deadline - time.monotonic()))
    except queue.Empty:
        pytest.fail(f"timed out waiting for {what}")


def pump_until(step, cond, what: str, timeout: float = DEADLINE_S) -> None:
    """Run the scheduler's per-step poll until cond() holds (a deadline, no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while True:
        step()
        if cond():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)  # yield the GIL to the controller's threads between polls


def assert_store_holds(store_dir, pages: int) -> dict:
    shards = find_shards(str(store_dir))
    assert len(shards) == 1, shards
    summary = shard_summary(shards[0])
    assert summary["pages"] == pages, summary
    assert summary["bytes_used"] >= pages * PAGE_BYTES, summary
    assert summary["problems"] == [] and summary["locked_by_writer"] is None, summary
    report = fsck(shards[0])
    assert report.clean, report
    return summary


def controller(store_dir, dev_tokens: int, model: str, **extra):
    """A CPU device pool, its allocator and host pool, and SGLang's HiCacheController with our backend."""
    device = MHATokenToKVPool(dev_tokens, PS, DTYPE, HEADS, HEAD_DIM, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS - 1)
    allocator = PagedTokenToKVPoolAllocator(dev_tokens, PS, DTYPE, "cpu", device, need_sort=False)
    host = host_pool_over(device, PS, "layer_first")
    ctl = HiCacheController(allocator, host, PS, None, threading.Event(), write_policy="write_through",
                            io_backend="direct", storage_backend="dynamic", prefetch_threshold=PS, model_name=model,
                            storage_backend_extra_config=backend_extra(store_dir, **extra), enable_storage_metrics=True)
    return device, allocator, host, ctl


# ------------------------------------------------------------------------ 1: HiCacheController directly
def test_hicache_controller_round_trip(tmp_path, single_rank):
    n_pages = STORAGE_BATCH_SIZE + 22  # two storage batches each way: 128 + 22 pages
    n_tokens = n_pages * PS
    g = torch.Generator().manual_seed(1234)
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PS))

    device, allocator, host, ctl = controller(tmp_path, 3 * n_pages * PS, "tiny-controller-test")
    try:
        backend = ctl.storage_backend
        assert isinstance(backend, KVTierStorage)
        assert ctl.page_set_func.__name__ == "_page_set_zero_copy"  # interface_v1 -> batch_set_v1/get_v1
        assert ctl.page_get_func.__name__ == "_page_get_zero_copy"
        calls: list = []
        spy_on(backend, calls)
        device_buffers = device.k_buffer + device.v_buffer

        # --- L1: known random KV in scattered, page-aligned device slots ------------------------
        slots = allocator.alloc(2 * n_pages * PS)
        order = torch.randperm(2 * n_pages, generator=g)[:n_pages].tolist()
        dev_idx = torch.cat([slots[p * PS:(p + 1) * PS] for p in order])
        randomize(device_buffers, g)
        original = snapshot(device_buffers, dev_idx)
        tokens = token_ids(n_tokens, "controller")

        # --- L1 -> L2: the controller's D2H write path -----------------------------------------
        host_idx = ctl.write(dev_idx, node_id=7)
        assert host_idx is not None and len(host_idx) == n_tokens
        assert len(ctl.ack_write_queue) == 1
        ack = ctl.ack_write_queue[0]
        ack.finish_event.synchronize()
        assert ack.finish_event.query() and ack.node_ids == [7] and ack.num_tokens == n_tokens
        ctl.ack_write_queue.clear()  # what the scheduler's writing_check does with a finished ack
        host_buffers = [host.kv_buffer[kv][layer] for kv in (0, 1) for layer in range(LAYERS)]  # layer_first
        assert snapshot(host_buffers, host_idx) == original

        # --- L2 -> L3: the backup thread writes our store --------------------------------------
        keys = get_storage_hash_str(tokens, None, page_size=PS)  # the controller's own page keys
        assert len(keys) == n_pages
        op_id = ctl.write_storage(host_idx, tokens, hash_value=keys)
        done = get_before(ctl.ack_backup_queue, time.monotonic() + DEADLINE_S, "the L3 backup ack")
        assert done.id == op_id and done.completed_tokens == n_tokens
        sets = called(calls, "batch_set_v1")
        assert [c[2] for c in sets] == [STORAGE_BATCH_SIZE, n_pages - STORAGE_BATCH_SIZE]
        assert all(all(c[3]) for c in sets)
        assert all("backup_thread_func" in c[1] for c in sets)
        stats = backend.get_stats()
        assert isinstance(stats, StorageMetrics)
        assert stats.backup_pgs == [STORAGE_BATCH_SIZE, n_pages - STORAGE_BATCH_SIZE]
        assert len(stats.backup_bandwidth) == 2 and all(bw > 0 for bw in stats.backup_bandwidth)
        assert stats.prefetch_pgs == []

        # --- drop L2 and L1: free the host copy and wipe both pools ----------------------------
        assert ctl.evict_host(host_idx) == n_tokens
        allocator.free(slots)
        host.kv_buffer.view(torch.uint8).zero_()
        for buf in device_buffers:
            buf.view(torch.uint8).zero_()

        # --- L3 -> L2: prefetch (batch_exists on the prefetch thread, batch_get_v1 on the IO thread)
        tail = token_ids(2 * PS, "never-stored")  # two pages past what L3 holds: a longest-prefix hit
        op = ctl.prefetch("req-controller", tokens + tail)
        deadline = time.monotonic() + DEADLINE_S
        hit = get_before(ctl.prefetch_hit_queue, deadline, "the storage hit query")
        assert hit is op and hit.storage_hit_count == n_tokens and hit.hash_value == keys
        exists = called(calls, "batch_exists")
        assert [(c[2], c[3]) for c in exists] == [(STORAGE_BATCH_SIZE, STORAGE_BATCH_SIZE),
                                                  (n_pages + 2 - STORAGE_BATCH_SIZE, n_pages - STORAGE_BATCH_SIZE)]
        assert all("prefetch_thread_func" in c[1] for c in exists)
        # Scheduler side (as UnifiedRadixCache does on a hit): a hit-sized host bounce, then the IO queue.
        holdout = host.alloc(8 * PS)  # so the prefetch lands on other host slots than the backup used
        bounce = ctl.alloc_prefetch_host_buffers(hit, hit.storage_hit_count)
        assert bounce is not None and len(bounce) == n_tokens and not torch.equal(bounce, host_idx)
        hit.host_indices = bounce
        ctl.prefetch_tokens_occupied += hit.storage_hit_count
        ctl.prefetch_buffer.put(hit)
        acks = []
        while not (acks and acks[-1].completed_req):
            acks.append(get_before(ctl.ack_prefetch_queue, deadline, "the prefetch completion ack"))
        assert [(a.completed_tokens, a.completed_req) for a in acks] == [
            (STORAGE_BATCH_SIZE * PS, None), (n_tokens, None), (None, True)]
        ctl.prefetch_tokens_occupied -= hit.storage_hit_count
        gets = called(calls, "batch_get_v1")
        assert [(c[2], c[3]) for c in gets] == [(STORAGE_BATCH_SIZE, [True] * STORAGE_BATCH_SIZE),
                                                (n_pages - STORAGE_BATCH_SIZE, [True] * (n_pages - STORAGE_BATCH_SIZE))]
        assert all("prefetch_io_aux_func" in c[1] for c in gets)
        stats = backend.get_stats()
        assert stats.prefetch_pgs == [STORAGE_BATCH_SIZE, n_pages - STORAGE_BATCH_SIZE]
        assert len(stats.prefetch_bandwidth) == 2 and stats.backup_pgs == []

        # --- L2 -> L1: the controller's H2D load path into fresh device slots --------------------
        new_dev_idx = ctl.load(bounce, node_id=8)
        assert new_dev_idx is not None and not torch.equal(new_dev_idx, dev_idx)
        assert ctl.start_loading() >= 0
        for load_ack in ctl.ack_load_queue:
            load_ack.finish_event.synchronize()
        ctl.ack_load_queue.clear()
        assert snapshot(device_buffers, new_dev_idx) == original  # byte-exact, every layer, K and V
        host.free(holdout)
    finally:
        ctl.detach_storage_backend()  # stops the four threads and closes our backend

    summary = assert_store_holds(tmp_path, n_pages)
    assert "tiny-controller-test" in summary["namespace"]


# ---------------------------------------------- 2: UnifiedRadixCache + HybridCacheController (the server)
class _PrivateRegistryCollector(StorageMetricsCollector):
    """SGLang's real storage collector, with its series in a registry of its own (no global clashes)."""

    def __init__(self, registry, labels):
        from prometheus_client import Counter, Gauge, Histogram

        self._counter_cls = functools.partial(Counter, registry=registry)
        self._gauge_cls = functools.partial(Gauge, registry=registry)
        self._histogram_cls = functools.partial(Histogram, registry=registry)
        super().__init__(labels=labels)


def _hicache(kit, store_dir, caches: list):
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    cfg = CacheConfig(page_size=PS, num_layers=LAYERS, head_num=HEADS, head_dim=HEAD_DIM, dtype=DTYPE,
                      kv_size=4096, max_context_len=4096)
    cache, allocator, _ = kit.build_fixture(cfg)
    server_args = ServerArgs(
        model_path="dummy", page_size=PS, hicache_io_backend="direct", hicache_mem_layout="layer_first",
        hicache_write_policy="write_through", hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(backend_extra(store_dir, prefetch_threshold=PS)),
        hicache_storage_prefetch_policy="wait_complete")
    set_global_server_args_for_scheduler(server_args)
    cache.init_hicache(server_args, cache.cache_init_params)
    kit.drop_hicache_atexit_pin(cache)
    caches.append(cache)
    assert type(cache.cache_controller).__name__ == "HybridCacheController"
    assert isinstance(cache.cache_controller.storage_backend, KVTierStorage)
    assert cache.cache_controller.page_get_func.__name__ == "_page_get_zero_copy"
    return cache, allocator


def _kv_buffers(allocator):
    pool = allocator.get_kvcache()
    return [pool.get_key_buffer(layer) for layer in range(pool.layer_num)] + \
        [pool.get_value_buffer(layer) for layer in range(pool.layer_num)]


def _sample(registry, name, labels):
    return registry.get_sample_value(name, labels) or 0


def test_unified_radix_cache_round_trip_across_restart(tmp_path, kit_on_cpu):
    from prometheus_client import CollectorRegistry

    n_pages = STORAGE_BATCH_SIZE + 12
    n_tokens = n_pages * PS
    g = torch.Generator().manual_seed(99)
    tokens = token_ids(n_tokens, "unified")
    registry = CollectorRegistry()
    labels = {"storage_backend": "dynamic", "tp_rank": "0"}
    collector = _PrivateRegistryCollector(registry, labels)
    caches: list = []
    try:
        # --- producer: a request's KV lands in the tree, write-through backs it up to L2 and L3 ---
        prod, prod_alloc = _hicache(kit_on_cpu, tmp_path, caches)
        prod.enable_storage_metrics = True  # --enable-metrics; the kits set a collector the same way
        prod.storage_metrics_collector = collector
        prod_calls: list = []
        spy_on(prod.cache_controller.storage_backend, prod_calls)
        value = prod_alloc.alloc(n_tokens)
        prod_buffers = _kv_buffers(prod_alloc)
        randomize(prod_buffers, g, rows=value)
        original = snapshot(prod_buffers, value)
        prod.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value))
        leaf = kit_on_cpu.match_prefix(prod, tokens).last_device_node
        assert prod.ongoing_write_through, "write_through did not queue a D2H backup on insert"
        pump_until(prod.check_hicache_events,
                   lambda: not prod.ongoing_write_through and not prod.ongoing_backup
                   and prod.tree_core.is_backuped(leaf), "the write-through D2H and L3 backup acks")
        assert prod.tree_core.get_hash_values(leaf) == get_storage_hash_str(tokens, None, page_size=PS)
        sets = called(prod_calls, "batch_set_v1")
        assert [c[2] for c in sets] == [STORAGE_BATCH_SIZE, n_pages - STORAGE_BATCH_SIZE]
        assert all(all(c[3]) and "backup_thread_func" in c[1] for c in sets)
        assert _sample(registry, "sglang:backuped_tokens_total", labels) == n_tokens
        assert _sample(registry, "sglang:backup_pgs_count", labels) == 2
        assert _sample(registry, "sglang:backup_pgs_sum", labels) == n_pages
        assert _sample(registry, "sglang:backup_bandwidth_count", labels) == 2
        ok, msg = prod.detach_storage_backend()  # closes our backend, as server shutdown does
        assert ok, msg

        # --- consumer: a fresh process's cache (empty L1/L2) fetches the prompt back from L3 ------
        cons, cons_alloc = _hicache(kit_on_cpu, tmp_path, caches)
        cons.enable_storage_metrics = True
        cons.storage_metrics_collector = collector
        cons_calls: list = []
        spy_on(cons.cache_controller.storage_backend, cons_calls)
        cons_buffers = _kv_buffers(cons_alloc)
        assert kit_on_cpu.match_prefix(cons, tokens).full_kv_hit_length == 0
        request = CacheRequestHandle("req-unified", 0)
        cons.prefetch_from_storage(request, cons.root_node_handle(), array("q", tokens), None, None)
        pump_until(cons.check_hicache_events, lambda: cons.check_prefetch_progress(request),
                   "the storage prefetch to complete")
        assert cons.pop_prefetch_loaded_tokens(request) == n_tokens
        exists = called(cons_calls, "batch_exists")
        assert [(c[2], c[3]) for c in exists] == [(n_pages, n_pages)]  # the whole span in one query
        assert "prefetch_thread_func" in exists[0][1]
        gets = called(cons_calls, "batch_get_v1")
        assert [c[2] for c in gets] == [STORAGE_BATCH_SIZE, n_pages - STORAGE_BATCH_SIZE]
        assert all(all(c[3]) and "prefetch_io_aux_func" in c[1] for c in gets)
        assert _sample(registry, "sglang:prefetched_tokens_total", labels) == n_tokens
        assert _sample(registry, "sglang:prefetch_pgs_count", labels) == 2
        assert _sample(registry, "sglang:prefetch_pgs_sum", labels) == n_pages

        match = kit_on_cpu.match_prefix(cons, tokens)
        assert match.device_prefix_len == 0 and match.host_hit_length == n_tokens
        assert cons.load_back(match.last_host_node)  # L2 -> L1, queued
        assert cons.ready_to_load_host_cache() >= 0  # batch formation starts the H2D
        pump_until(cons.check_hicache_events, lambda: not cons.cache_controller.ack_load_queue,
                   "the H2D load ack")
        match = kit_on_cpu.match_prefix(cons, tokens)
        assert match.device_prefix_len == n_tokens
        loaded_rows = cons.path_device_indices(match.last_device_node)
        assert snapshot(cons_buffers, loaded_rows) == original  # byte-exact, every layer, K and V
        ok, msg = cons.detach_storage_backend()
        assert ok, msg
    finally:
        for cache in caches:
            if cache.cache_controller is not None and cache.cache_controller.enable_storage:
                cache.detach_storage_backend()
            cache.release_host_resources()

    assert_store_holds(tmp_path, n_pages)
