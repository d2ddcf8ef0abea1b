"""The cost-policy plugin (``plugins.prefetch``) on SGLang 0.5.23's real classes (CPU), and the backend's cost inputs.

- Off (``KVTIER_PREFETCH_POLICY`` unset): ``load()`` registers nothing and no SGLang class changes.
- On: ``load()`` + ``HookRegistry.apply_hooks()`` (what ``load_plugins()`` does) wrap
  ``UnifiedRadixCache._can_terminate_prefetch`` and ``Scheduler.process_batch_result``; a real
  ``UnifiedRadixCache`` (SGLang's unit kit, ``dynamic`` backend = ours) then stops prefetches as
  ``cost_model.should_terminate`` says, on constructed operations and through ``check_prefetch_progress``.
- ``batch_exists`` shortens the hit only with the policy on and a load predicted slower than recompute.

Every test restores SGLang's classes and the hook registry. Synchronisation is by the controller's own
queues (blocking gets), never by sleeping; the read path and prefill speed are set from synthetic samples,
so no verdict depends on how fast the machine running the tests is.
"""

from __future__ import annotations

import json
import logging
from array import array

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

if torch.cuda.is_available():  # pragma: no cover - the CPU harness builds CPU pools
    pytest.skip("CPU harness: builds CPU KV pools and uses the CPU shims", allow_module_level=True)

from hook_kit import keep_hooks  # noqa: E402
from pools import mha_host_pool, storage_config  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

from sgl_kvtier.experiments.cost_policy import plugin as prefetch_plugin  # noqa: E402
from sgl_kvtier.policy import cost_inputs  # noqa: E402
from sgl_kvtier.policy.cost_model import LoadProgress, PrefillModel, RequestShape, should_terminate  # noqa: E402
from sgl_kvtier.sglang import KVTierStorage, prefill_samples  # noqa: E402
from sgl_kvtier.store.read_rates import ReadRates  # noqa: E402
from sgl_kvtier.telemetry.counters import BoundaryCounts  # noqa: E402

PS, LAYERS, HEADS, HEAD_DIM = 16, 2, 2, 64
PAGE_BYTES = PS * LAYERS * 2 * HEADS * HEAD_DIM * 2  # bf16 K and V of every layer
N_PAGES = 140  # two storage batches
FAST_PREFILL = PrefillModel(1e-7, 0.0, 1e-4)  # recomputing 2240 tokens: ~0.3 ms
SLOW_PREFILL = PrefillModel(1e-3, 1e-4, 0.05)  # recomputing 2240 tokens: ~2.5 s
T0 = 1000.0
TARGETS = ((UnifiedRadixCache, "_can_terminate_prefetch"), (Scheduler, "process_batch_result"))

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture
def pristine(monkeypatch, cpu_shims):
    """Hook registry, SGLang's classes and the plugin's load flag and clock come back as they were after the test."""
    originals = keep_hooks(monkeypatch, TARGETS)
    monkeypatch.setattr(prefetch_plugin, "_loaded", False)
    monkeypatch.setattr(prefetch_plugin, "_clock", lambda: T0)
    monkeypatch.setattr(prefill_samples, "_clock", lambda: T0)
    return originals


@pytest.fixture
def policy_on(pristine, monkeypatch):
    monkeypatch.setenv(cost_inputs.ENV_POLICY, "cost")
    prefetch_plugin.load()
    HookRegistry.apply_hooks()
    return pristine


@pytest.fixture
def cache(tmp_path, policy_on, monkeypatch):
    """A real UnifiedRadixCache + HybridCacheController with our backend, SGLang's ``timeout`` policy."""
    from sglang.test.kits.unified_radix_cache import fixtures
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    monkeypatch.setattr(fixtures, "get_device", lambda *a, **k: "cpu")
    extra = {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang", "class_name": "KVTierStorage",
             "interface_v1": 1, "devices": [str(tmp_path)], "capacity_bytes": 64 << 20, "prefetch_threshold": PS,
             "readahead_bytes": 64 << 20}  # read-ahead on (off by default): the measured reads are its chunks
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        cfg = CacheConfig(page_size=PS, num_layers=LAYERS, head_num=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16,
                          kv_size=4096, max_context_len=4096)
        c, _, _ = fixtures.build_fixture(cfg)
        args = ServerArgs(model_path="dummy", page_size=PS, hicache_io_backend="direct",
                          hicache_mem_layout="layer_first", hicache_write_policy="write_through",
                          hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(extra),
                          hicache_storage_prefetch_policy="timeout")
        set_global_server_args_for_scheduler(args)
        c.init_hicache(args, c.cache_init_params)
        fixtures.drop_hicache_atexit_pin(c)
        assert c.prefetch_stop_policy == "timeout"
        assert isinstance(c.cache_controller.storage_backend, KVTierStorage)
        try:
            yield c
        finally:
            if c.cache_controller is not None and c.cache_controller.enable_storage:
                c.detach_storage_backend()
            c.release_host_resources()


def set_device(backend: KVTierStorage, bandwidth_Bps: float, batch_latency_s: float) -> None:
    """Synthetic read samples (two batch sizes) that pin the measured read model."""
    backend.kv.store.read_rates = ReadRates(1)  # forget what was measured so far
    for pages in (16, 128, 16, 128):
        backend.kv.store.read_rates.record([0] * pages, PAGE_BYTES, batch_latency_s + pages * PAGE_BYTES / bandwidth_Bps)
    m = backend.kv.store.read_rates.model()
    assert m.bandwidth_Bps == pytest.approx(bandwidth_Bps) and m.batch_latency_s == pytest.approx(batch_latency_s)


def operation(hit_pages: int, loaded_pages: int, elapsed_s: float) -> PrefetchOperation:
    """A PrefetchOperation in the state SGLang's scheduler leaves it once the hit is allocated."""
    span = hit_pages * PS + PS
    op = PrefetchOperation(CacheRequestHandle("req-op", 0), list(range(span)))
    op.stats_requested_tokens, op.storage_start = span, 3 * PS
    op.storage_hit_count = hit_pages * PS
    op.hash_value = [f"{i:064x}" for i in range(hit_pages)]
    op.host_indices = torch.arange(hit_pages * PS)
    op.completed_tokens = loaded_pages * PS
    op.start_time = T0 - elapsed_s
    return op


def expected(backend, hit_pages, loaded_pages, elapsed_s) -> bool:
    shape = RequestShape(PS, PAGE_BYTES, hit_pages, cached_tokens=3 * PS, tail_tokens=PS)
    return should_terminate(shape, LoadProgress(loaded_pages, elapsed_s), backend.kv.store.read_rates.model(),
                            backend.cost.prefill.model()).terminate


# ---------------------------------------------------------------------------------------------- registration

@pytest.mark.parametrize("value", [None, "", "off", "timeout"])
def test_off_touches_nothing(pristine, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(cost_inputs.ENV_POLICY, raising=False)
    else:
        monkeypatch.setenv(cost_inputs.ENV_POLICY, value)
    hooks_before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    prefetch_plugin.load()
    HookRegistry.apply_hooks()
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == hooks_before
    assert prefetch_plugin.TERMINATE_TARGET not in HookRegistry._hooks
    for cls, name in TARGETS:
        assert cls.__dict__[name] is pristine[name]
    assert not prefetch_plugin._loaded


def test_on_wraps_the_real_methods(policy_on):
    for cls, name in TARGETS:
        wrapped = cls.__dict__[name]
        assert wrapped is not policy_on[name] and wrapped.__wrapped__ is policy_on[name]
    assert prefetch_plugin.TERMINATE_TARGET in HookRegistry._patched
    prefetch_plugin.load()  # idempotent: no second registration
    assert len(HookRegistry._hooks[prefetch_plugin.TERMINATE_TARGET]) == 1


# ---------------------------------------------------------------------------------------------- stop decision
def test_stop_decision_follows_the_cost_model(cache):
    backend = cache.cache_controller.storage_backend
    backend.cost.prefill.estimator.seed = SLOW_PREFILL
    set_device(backend, bandwidth_Bps=2e9, batch_latency_s=1e-3)  # loading 140 pages: ~2 ms
    for loaded, elapsed in [(0, 0.0), (0, 0.01), (128, 0.01)]:
        assert cache._can_terminate_prefetch(operation(N_PAGES, loaded, elapsed)) is False
        assert expected(backend, N_PAGES, loaded, elapsed) is False
    stalled = (128, 10.0)  # 10 s in, the second batch overdue by ~10 s: recomputing 12 pages is faster
    assert cache._can_terminate_prefetch(operation(N_PAGES, *stalled)) is True
    assert expected(backend, N_PAGES, *stalled) is True
    assert cache._can_terminate_prefetch(operation(N_PAGES, N_PAGES, 99.0)) is False  # landed: never cut

    set_device(backend, bandwidth_Bps=1e6, batch_latency_s=0.5)  # now ~3.3 s for 140 pages
    backend.cost.prefill.estimator.seed = FAST_PREFILL
    assert cache._can_terminate_prefetch(operation(N_PAGES, 0, 0.0)) is True
    assert expected(backend, N_PAGES, 0, 0.0) is True


def test_unmeasured_inputs_defer_to_sglang_and_other_policies_run_unchanged(cache):
    backend = cache.cache_controller.storage_backend
    set_device(backend, bandwidth_Bps=1e6, batch_latency_s=0.5)
    assert backend.cost.prefill.model() is None  # no prefill samples, no seed: SGLang's own timeout decides
    assert cache._can_terminate_prefetch(operation(N_PAGES, 0, 50.0)) is False  # no wait started: not expired
    backend.cost.prefill.estimator.seed = FAST_PREFILL
    assert cache._can_terminate_prefetch(operation(N_PAGES, 0, 0.0)) is True
    cache.prefetch_stop_policy = "wait_complete"  # an explicit operator choice: SGLang's method, untouched
    assert cache._can_terminate_prefetch(operation(N_PAGES, 0, 0.0)) is False


def _stored_prompt(backend: KVTierStorage) -> list[int]:
    tokens = [(i * 7919) % 30000 for i in range(N_PAGES * PS)]
    keys = get_storage_hash_str(tokens, None, page_size=PS)
    assert backend.batch_set_v1(keys, torch.arange(N_PAGES * PS)) == [True] * N_PAGES
    return tokens


def _take(q, count_until, what):
    """Blocking gets from a controller queue until ``count_until(items)``, then the items go back, in order."""
    items = []
    while not count_until(items):
        items.append(q.get(timeout=30))
    for item in items:
        q.put(item)
    return items


def _freeze_clock(cache, request, monkeypatch) -> None:
    """The policy's clock stands 1 ms after the operation was issued: verdicts never depend on machine speed."""
    op = cache.ongoing_prefetch[request].operation
    monkeypatch.setattr(prefetch_plugin, "_clock", lambda: op.start_time + 0.001)


def test_check_prefetch_progress_cuts_a_slow_load_at_once(cache, monkeypatch):
    backend = cache.cache_controller.storage_backend
    tokens = _stored_prompt(backend)
    set_device(backend, bandwidth_Bps=1e6, batch_latency_s=0.5)
    backend.cost.prefill.estimator.seed = FAST_PREFILL
    request = CacheRequestHandle("req-slow", 0)
    cache.prefetch_from_storage(request, cache.root_node_handle(), array("q", tokens), None, None)
    _freeze_clock(cache, request, monkeypatch)
    hit = _take(cache.cache_controller.prefetch_hit_queue, lambda xs: bool(xs), "the hit query")[0]
    assert hit.storage_hit_count == 0  # batch_exists reported no hit worth loading
    assert cache.check_prefetch_progress(request) is True  # SGLang's timeout alone would keep waiting
    cache.check_hicache_events()
    assert cache.pop_prefetch_loaded_tokens(request) == 0
    assert not cache.ongoing_prefetch


def test_check_prefetch_progress_waits_for_a_fast_load(cache, monkeypatch):
    backend = cache.cache_controller.storage_backend
    tokens = _stored_prompt(backend)
    set_device(backend, bandwidth_Bps=2e9, batch_latency_s=1e-3)
    backend.cost.prefill.estimator.seed = SLOW_PREFILL
    request = CacheRequestHandle("req-fast", 0)
    cache.prefetch_from_storage(request, cache.root_node_handle(), array("q", tokens), None, None)
    _freeze_clock(cache, request, monkeypatch)
    cc = cache.cache_controller
    hit = _take(cc.prefetch_hit_queue, lambda xs: bool(xs), "the hit query")[0]
    assert hit.storage_hit_count == N_PAGES * PS
    cache.check_hicache_events()  # allocates the host bounce, queues the IO
    assert hit.host_indices is not None and hit.completed_tokens == 0
    assert cache.check_prefetch_progress(request) is False  # in flight and worth it: wait
    _take(cc.ack_prefetch_queue, lambda xs: bool(xs) and bool(xs[-1].completed_req), "the completion ack")
    cache.check_hicache_events()  # drains the acks: the pages are in host memory
    assert cache.check_prefetch_progress(request) is True
    assert cache.pop_prefetch_loaded_tokens(request) == N_PAGES * PS
    # The real reads were measured: read-ahead read the 128 + 12 pages of SGLang's two exists calls in chunks
    # of io_depth (32): 4 + 1 batches, and SGLang's two gets took every page from staging.
    assert backend.cost_inputs()["pools"]["kv"]["read"]["samples"] == 4 + 5
    assert backend.kv.readahead.counters.served == N_PAGES


# ---------------------------------------------------------------------------------------------- prefill timing
def scheduler_over(cache) -> Scheduler:
    """A Scheduler whose tree is ``cache`` (the one attribute the timing hook reads), built without start-up."""
    scheduler = object.__new__(Scheduler)
    scheduler.tree_cache = cache
    return scheduler


def extend_batch(mode_name: str, extend, prefix, launched):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return ScheduleBatch(reqs=[], forward_mode=ForwardMode[mode_name], extend_lens=extend, prefix_lens=prefix,
                         launch_ts=launched)


def test_prefill_timing_hook_records_extend_batches_after_warmup(cache):
    backend, scheduler = cache.cache_controller.storage_backend, scheduler_over(cache)
    for i in range(cost_inputs.WARMUP_BATCHES + 5):
        prefetch_plugin.record_prefill_timing(None, scheduler, extend_batch("EXTEND", [100 * (i + 1)], [0],
                                                                            T0 - 0.1 * (i + 1)))
    prefetch_plugin.record_prefill_timing(None, scheduler, extend_batch("DECODE", [1], [50], T0 - 5))
    prefetch_plugin.record_prefill_timing(None, scheduler, object())  # malformed: skipped, never raised
    prefetch_plugin.record_prefill_timing(None, None, extend_batch("EXTEND", [100], [0], T0 - 0.1))  # no backend
    assert backend.cost.prefill.estimator.samples == 5
    m = backend.cost.prefill.model()
    assert m.time(1000, 0) == pytest.approx(1.0, rel=1e-6)  # 0.1 s per 100 tokens
    assert backend.telemetry().boundary == BoundaryCounts()


def test_a_bug_in_the_policy_falls_back_to_sglang_counted_with_its_traceback(cache, monkeypatch, caplog):
    backend = cache.cache_controller.storage_backend
    message = "injected bug in the cost policy"

    def bug(*args, **kwargs):
        raise TypeError(message)

    monkeypatch.setattr(backend.cost, "inputs", bug)
    monkeypatch.setattr(backend.cost.prefill, "record_batch", bug)
    with caplog.at_level(logging.ERROR, logger="sgl_kvtier"):
        # The stop hook answers SGLang's own timeout verdict (no wait started: not expired); the collective ran.
        assert cache._can_terminate_prefetch(operation(N_PAGES, 0, 50.0)) is False
        prefetch_plugin.record_prefill_timing(None, scheduler_over(cache), extend_batch("EXTEND", [64], [0], T0 - 1))
    assert backend.telemetry().boundary == BoundaryCounts(expected=0, unexpected=2)
    records = [r for r in caplog.records if message in r.getMessage()]
    assert [r.exc_info[0] for r in records] == [TypeError, TypeError]
    assert "stop decision" in records[0].getMessage() and "prefill timing" in records[1].getMessage()


# ---------------------------------------------------------------------------------------------- backend side
def test_batch_exists_shortens_only_with_the_policy_on_and_a_slow_device(tmp_path, pristine, monkeypatch):
    pool = mha_host_pool("layer_first", page_size=PS, tokens=4096)
    cfg = {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang", "class_name": "KVTierStorage",
           "interface_v1": 1, "devices": [str(tmp_path)], "capacity_bytes": 64 << 20}
    backend = KVTierStorage(storage_config(cfg), {})
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()  # as SGLang's controller does once every pool is registered
    try:
        keys = [f"{i:064x}" for i in range(40)]
        assert backend.batch_set_v1(keys, torch.arange(40 * PS)) == [True] * 40
        backend.cost.prefill.estimator.seed = FAST_PREFILL
        set_device(backend, bandwidth_Bps=1e6, batch_latency_s=0.5)
        monkeypatch.delenv(cost_inputs.ENV_POLICY, raising=False)
        assert backend.batch_exists(keys) == 40  # off: the store's answer
        monkeypatch.setenv(cost_inputs.ENV_POLICY, "cost")
        assert backend.batch_exists(keys) == 0  # loading is slower than recomputing: no hit
        assert backend.exists(keys[0])  # the legacy presence check is not a load decision
        set_device(backend, bandwidth_Bps=2e9, batch_latency_s=1e-3)
        assert backend.batch_exists(keys + ["f" * 64]) == 0  # a fast device, but recomputing is faster still
        backend.cost.prefill.estimator.seed = SLOW_PREFILL
        assert backend.batch_exists(keys + ["f" * 64]) == 40
        inputs = backend.cost_inputs()
        assert inputs["policy"] == "cost" and inputs["prefill"]["source"] == "seed"
        assert inputs["pools"]["kv"]["read"]["samples"] == 4
        assert [d["path"] for d in inputs["pools"]["kv"]["devices"]] == [str(tmp_path)]
        json.dumps(inputs)  # log- and JSON-ready
        assert isinstance(backend.get_stats(), StorageMetrics)  # SGLang's metrics path unchanged
    finally:
        backend.close()
