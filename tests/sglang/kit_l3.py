"""SGLang's own UnifiedRadixCache test kits, driving KVTierStorage (the ``dynamic`` backend) on the CPU.

The kits ship in SGLang's wheel (``sglang.test.kits.unified_radix_cache``): ``UnifiedRadixCacheStorageFixtures``
(produce a prefix to L3 with one cache, consume it with another, flush and drain backups, ground-truth
existence), ``UnifiedRadixPrefetchCorruptionFixtures`` (a host chain committed under corrupt page hashes)
and ``UnifiedRadixCacheStorageAttachBackfillFixtures`` (a tree built before storage was attached, and its
hash chains); their cache configs (``config.CONFIGS``) are the model shapes. ``KVTierKit`` is those
fixtures with one hook of theirs, ``_init_hicache``, pointed at our backend instead of SGLang's ``file``
backend: every kit helper that opens an L3 cache (``_l3_produce``, ``_l3_consumer``, ...) then opens
ours, on the kit's storage directory, through SGLang's real ``UnifiedRadixCache.init_hicache`` ->
``HybridCacheController`` -> ``dynamic`` backend factory.

What the CPU needs (``sgl_kvtier.sglang.plugins.cpu_shims`` says why): host pools with ``pin_memory=False``
and the ``transfer_kv_direct`` stand-in (the ``cpu_shims`` fixture), ``io_backend="direct"`` with the
``layer_first`` host layout (the kit's own ``kernel`` copy engine needs a GPU), and the kit's ``get_device``
pointed at ``"cpu"``.

One cache per directory at a time: the kit's flows model a producer process that exits before its consumer
starts (with ``sharing = "off"`` a second cache on a directory a first one still holds gets
``StoreLockedError``, as ``test_kit_l3`` shows; by default it would join the pool as a second writer). So
opening an L3 cache on a directory first detaches the cache that had it (``_hand_over``); the kit's
produce-then-consume flows are sequential and run unchanged. A test whose caches run side by side, as
writer processes of one pool do, marks the directory ``_pooled`` first: a cache opened on it joins the
pool as one more writer, and the caches already there keep serving. Every test ends with nothing of ours left: no
descriptor under its storage directories, no ``kvtier-*`` thread (``_assert_released``, the last clean-up).
"""

from __future__ import annotations

import json
import unittest
from typing import Any
from unittest import mock

import pytest
from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE as FLA_CHUNK_SIZE
from sglang.srt.runtime_context import get_parallel
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.test.kits.unified_radix_cache import fixtures as kit
from sglang.test.kits.unified_radix_cache.config import CONFIGS, CacheConfig, config_attrs
from sglang.test.kits.unified_radix_cache.storage import (
    UnifiedRadixCacheStorageAttachBackfillFixtures,
    UnifiedRadixCacheStorageFixtures,
    UnifiedRadixPrefetchCorruptionFixtures,
)
from support import kvtier_threads, open_fds_under

from sgl_kvtier.sglang import KVTierStorage

LIMIT = 256 << 20  # capacity_bytes of every backend here
CPU_LAYOUT = "layer_first"


def backend_extra(storage_dir: str, prefetch_threshold: int | None = None, **more: Any) -> dict[str, Any]:
    """The extra-config dict of our backend on ``storage_dir`` (SGLang's keys included)."""
    extra: dict[str, Any] = {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang",
                             "class_name": "KVTierStorage", "interface_v1": 1, "devices": [storage_dir],
                             "capacity_bytes": LIMIT, **more}
    if prefetch_threshold is not None:
        extra["prefetch_threshold"] = prefetch_threshold
    return extra


# The configs whose pools the CPU can build, and why the others cannot (exact, measured on 0.5.23).
MAMBA_ON_CPU = ("MambaPoolHost allocates its host buffer with cudaHostRegister unconditionally "
                "(pool_host/mamba.py:254 -> common.py:147 'Found no NVIDIA driver'), and its only layouts are "
                "page-first ones (layer_first: 'Unsupported layout', mamba.py:103), whose device<->host copy is "
                "sgl_kernel's transfer_kv_all_layer_direct_lf_pf (no CPU stand-in)")
SWA_AND_MAMBA = "the kit itself excludes SWA + Mamba stacks from HiCache (config.supports_hicache)"


def cannot_run(cfg: CacheConfig) -> str | None:
    """Why the kit config ``cfg`` cannot run here, or None when it runs."""
    if cfg.has_swa and cfg.has_mamba:
        return SWA_AND_MAMBA
    if cfg.has_mamba:
        return MAMBA_ON_CPU
    return None


RUNNABLE = [cfg for cfg in CONFIGS if cannot_run(cfg) is None]


@pytest.mark.usefixtures("cpu_shims")
class KVTierKit(UnifiedRadixCacheStorageFixtures, UnifiedRadixPrefetchCorruptionFixtures,
                UnifiedRadixCacheStorageAttachBackfillFixtures):
    """The kits' fixtures with their L3 caches on KVTierStorage (see the module docstring)."""

    cfg: CacheConfig
    store_extra: dict[str, Any] = {}  # our config keys for every backend a test opens (beyond backend_extra's)

    def setUp(self) -> None:
        super().setUp()
        self.ps = self.cfg.page_size  # the corruption fixtures' name for it
        threads_before = kvtier_threads()
        self._storage_dirs: list[str] = []
        self.addCleanup(self._assert_released, threads_before)  # first registered: runs last
        patcher = mock.patch.object(kit, "get_device", return_value="cpu")
        patcher.start()
        self.addCleanup(patcher.stop)
        self._holders: dict[str, Any] = {}  # storage dir -> the cache whose backend holds it
        self._pooled: set[str] = set()  # storage dirs whose caches run side by side (one pool, many writers)

    # ------------------------------------------------------------------ the kit's hook, on our backend
    def _init_hicache(self, cache, *, write_policy: str = "write_through", storage_backend: str | None = None,
                      storage_dir: str | None = None, prefetch_threshold: int | None = None,
                      prefetch_policy: str = "wait_complete", host_memory_mode: str = "cache",
                      storage_extra: dict | None = None, context_length: int | None = None) -> None:
        """HiCache on ``cache`` as the kit's own hook does it, with our backend for any L3 it asks for."""
        override = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)  # no distributed state
        override.__enter__()
        self.addCleanup(override.__exit__, None, None, None)
        extra_json = None
        if storage_backend is not None:
            assert storage_dir is not None, "an L3 cache needs the kit's storage directory"
            if storage_dir not in self._pooled:
                self._hand_over(storage_dir)
            extra_json = json.dumps(backend_extra(storage_dir, prefetch_threshold,
                                                  **{**self.store_extra, **(storage_extra or {})}))
        server_args = ServerArgs(
            model_path="dummy", page_size=self.cfg.page_size, hicache_io_backend="direct",
            hicache_mem_layout=CPU_LAYOUT, hicache_write_policy=write_policy,
            hicache_storage_backend=None if storage_backend is None else "dynamic",
            hicache_storage_backend_extra_config=extra_json, hicache_storage_prefetch_policy=prefetch_policy,
            hicache_host_memory_mode=host_memory_mode, context_length=context_length)
        server_args._mamba_cache_chunk_size = max(FLA_CHUNK_SIZE, self.cfg.page_size)
        set_global_server_args_for_scheduler(server_args)
        cache.init_hicache(server_args, cache.cache_init_params)
        self.addCleanup(kit.drop_hicache_atexit_pin, cache)
        self.addCleanup(cache.release_host_resources)
        cache.write_through_threshold = 1 << 30  # the kit's: backups only when a test asks for them
        cache.load_back_threshold = 0
        if storage_backend is not None:
            controller = cache.cache_controller
            assert isinstance(controller.storage_backend, KVTierStorage)
            # The kit's fixtures size host and device pools alike: allow one pool of prefetch tokens.
            controller.prefetch_capacity_limit = max(controller.prefetch_capacity_limit, controller.mem_pool_host.size)
            self._holders[storage_dir] = cache
            if storage_dir not in self._storage_dirs:
                self._storage_dirs.append(storage_dir)
            self.addCleanup(self._detach, cache)

    def _hand_over(self, storage_dir: str) -> None:
        """One writer per shard: the cache holding ``storage_dir`` lets go first (its process exits)."""
        holder = self._holders.pop(storage_dir, None)
        if holder is not None:
            self._detach(holder)

    def _detach(self, cache) -> None:
        controller = cache.cache_controller
        if controller is not None and controller.storage_backend is not None:
            ok, msg = cache.detach_storage_backend()  # SGLang's admin path: stops its threads, closes ours
            self.assertTrue(ok, msg)

    def _attach(self, cache, storage_dir: str, **more: Any) -> KVTierStorage:
        """SGLang's runtime attach (the admin ``PUT /hicache/storage-backend`` path) of our backend."""
        self._hand_over(storage_dir)
        ok, msg = cache.attach_storage_backend(
            "dynamic", json.dumps(backend_extra(storage_dir, prefetch_threshold=1, **{**self.store_extra, **more})),
            served_model_name="dummy")
        self.assertTrue(ok, msg)
        self._holders[storage_dir] = cache
        if storage_dir not in self._storage_dirs:
            self._storage_dirs.append(storage_dir)
        self.addCleanup(self._detach, cache)
        backend = cache.cache_controller.storage_backend
        assert isinstance(backend, KVTierStorage)
        return backend

    @staticmethod
    def backend(cache) -> KVTierStorage:
        """The KVTierStorage a cache's controller holds."""
        backend = cache.cache_controller.storage_backend
        assert isinstance(backend, KVTierStorage)
        return backend

    def _assert_released(self, threads_before: set) -> None:
        for storage_dir in self._storage_dirs:
            self.assertEqual(open_fds_under(storage_dir), {}, f"descriptors left under {storage_dir}")
        self.assertEqual(kvtier_threads() - threads_before, set(), "kvtier threads left running")


def config_classes(suite: type, namespace: dict[str, Any]) -> None:
    """``Test_<label>`` in ``namespace`` for each kit config the CPU runs (``RUNNABLE``), binding ``suite``
    as the kit's ``define_config_test_classes`` does, on plain ``unittest.TestCase`` (no retries)."""
    for cfg in RUNNABLE:
        name = f"Test_{cfg.label}"
        cls = type(name, (suite, unittest.TestCase), config_attrs(suite, cfg))
        cls.__module__ = namespace["__name__"]
        namespace[name] = cls
