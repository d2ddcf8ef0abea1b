"""KVTierStorage: SGLang's HiCache L3 backend on the sgl-kvtier page store.

Loaded by SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name":"kvtier","module_path":"sgl_kvtier.sglang","class_name":"KVTierStorage","interface_v1":1,
      "devices":["/mnt/nvme0/kvtier"], "capacity_bytes": 400000000000}'

Lifecycle: ``cls(storage_config, {})`` validates our keys (a bad one raises ``ConfigError`` naming it,
which stops start-up); ``register_mem_pool_host(pool)`` derives the namespace from the config and the
pool and opens the store. Side pools (``register_mem_host_pool_v2``) get stores of their own.

Boundary rule: SGLang calls exists / get / set from three threads; nothing raises into them. IO faults
and bad arguments become a miss (``False`` / 0 / ``None``), are counted, and logged without flooding.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from sgl_kvtier.errors import KVTierError
from sgl_kvtier.keys import PageKey, parse_key
from sgl_kvtier.metrics import RateLimitedLog
from sgl_kvtier.sglang.host_pages import HostPages, check_indices
from sgl_kvtier.sglang.pool_tier import PoolTier
from sgl_kvtier.sglang.settings import store_config
from sgl_kvtier.sglang.sidecars import exists_v2
from sgl_kvtier.sglang import prometheus, throughput
from sgl_kvtier.sglang.stats import TransferStats

log = logging.getLogger(__name__)
_BOUNDARY_ERRORS = (KVTierError, OSError, ValueError, RuntimeError)


class KVTierStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.config = store_config(storage_config.extra_config)
        self.writer = bool(storage_config.is_storage_writer)
        self.tiers: dict[str, PoolTier] = {}
        self.stats = TransferStats(enabled=True)
        self._errlog = RateLimitedLog(log)
        self._lock = threading.Lock()
        self.kv: PoolTier | None = None

    # ------------------------------------------------------------------ registration
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.kv = self._tier("kv", mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name != "kv":
            self._tier(name, host_pool)

    def _tier(self, name: str, pool: Any) -> PoolTier:
        with self._lock:
            tier = self.tiers.get(name)
            if tier is None or tier.pages.pool is not pool:
                tier = PoolTier.open(name, HostPages.of(pool), self.storage_config, self.config, self.writer)
                self.tiers[name] = tier
                log.info("kvtier: pool %s -> %s (%s, %d-byte pages, %s)", name, tier.namespace.dirname(),
                         tier.namespace.describe(), tier.pages.page_bytes, tier.pages.access.value)
            return tier

    # ------------------------------------------------------------------ v1: zero-copy KV
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        parsed = _keys_until_invalid(keys)
        hit = self._stored_prefix(parsed)
        # With KVTIER_PREFETCH_POLICY=cost: only the leading pages predicted to load faster than recompute.
        hit = throughput.shorten_hit(self, len(keys), hit, len(getattr(extra_info, "prefix_keys", None) or ()))
        try:
            self._kv().stage(parsed[:hit])  # read-ahead: the reads start now, batch_get_v1 collects them
        except _BOUNDARY_ERRORS as exc:
            self._fail("batch_exists read-ahead", exc)
        return hit

    def _stored_prefix(self, keys: list[PageKey]) -> int:
        try:
            return self._kv().longest_prefix(keys)
        except _BOUNDARY_ERRORS as exc:
            self._fail("batch_exists", exc)
            return 0

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        start = time.perf_counter()
        try:
            result = self._kv().read(_keys_or_none(keys), host_indices)
        except _BOUNDARY_ERRORS as exc:
            self._fail("batch_get_v1", exc)
            return [False] * len(keys)
        self.stats.record_get(sum(result), self._kv().pages.page_bytes, time.perf_counter() - start)
        return result

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if not self.writer:
            return [True] * len(keys)  # another rank writes this replicated shard
        start = time.perf_counter()
        try:
            parent = _parent_of(extra_info)
            result = self._kv().write(_keys_or_none(keys), host_indices, parent)
        except _BOUNDARY_ERRORS as exc:
            self._fail("batch_set_v1", exc)
            return [False] * len(keys)
        self.stats.record_set(sum(result), self._kv().pages.page_bytes, time.perf_counter() - start)
        return result

    # ------------------------------------------------------------------ legacy: flat page tensors
    def exists(self, key: str) -> bool:
        return self._stored_prefix(_keys_until_invalid([key])) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None):
        try:
            if target_locations is None:
                target_locations = [self._kv().pages.pool.get_dummy_flat_data_page() for _ in keys]
            oks = self._kv().read_flat(_keys_or_none(keys), list(target_locations))
        except _BOUNDARY_ERRORS as exc:
            self._fail("batch_get", exc)
            return [None] * len(keys)
        return [t if ok else None for t, ok in zip(target_locations, oks)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not self.writer:
            return True
        try:
            return all(self._kv().write_flat(_keys_or_none(keys), list(values)))
        except _BOUNDARY_ERRORS as exc:
            self._fail("batch_set", exc)
            return False

    # ------------------------------------------------------------------ v2: side pools
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        try:
            return exists_v2(self, _keys_until_invalid(keys), pool_transfers or [])
        except _BOUNDARY_ERRORS as exc:
            self._fail("batch_exists_v2", exc)
            return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return {str(t.name): self._transfer(t, write=False, extra_info=extra_info) for t in transfers}

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return {str(t.name): self._transfer(t, write=True, extra_info=extra_info) for t in transfers}

    def _transfer(self, t: PoolTransfer, write: bool, extra_info: Any) -> List[bool]:
        keys = list(t.keys or [])
        try:
            tier = self.tiers[str(t.name)]
            if write:
                return tier.write(_keys_or_none(keys), t.host_indices, _parent_of(extra_info)) if self.writer \
                    else [True] * len(keys)
            return tier.read(_keys_or_none(keys), t.host_indices)
        except (KeyError, *_BOUNDARY_ERRORS) as exc:
            self._fail(f"batch_{'set' if write else 'get'}_v2[{t.name}]", exc)
            return [False] * len(keys)

    # ------------------------------------------------------------------ admin
    def clear(self) -> None:
        for tier in self.tiers.values():
            try:
                tier.clear()
            except _BOUNDARY_ERRORS as exc:
                self._fail("clear", exc)

    def get_stats(self):
        prometheus.update(self)  # kvtier_ gauges: at most once per KVTIER_METRICS_INTERVAL_S, never raises
        return self.stats.drain()

    def cost_inputs(self) -> dict:
        """The cost policy's measured inputs: read bandwidth / batch latency per pool and device, prefill speed."""
        return throughput.cost_inputs(self)

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()
        self.tiers.clear()

    def _kv(self) -> PoolTier:
        if self.kv is None:
            raise KVTierError("no host pool registered yet")
        return self.kv

    def _fail(self, op: str, exc: BaseException) -> None:
        self.stats.errors += 1
        self._errlog.error("kvtier %s failed (served as a miss): %s: %s", op, type(exc).__name__, exc)


def _keys_or_none(keys: List[str]) -> list[PageKey | None]:
    out: list[PageKey | None] = []
    for k in keys:
        try:
            out.append(parse_key(k))
        except ValueError:
            out.append(None)
    return out


def _keys_until_invalid(keys: List[str]) -> list[PageKey]:
    out = []
    for k in _keys_or_none(keys):
        if k is None:
            break
        out.append(k)
    return out


def _parent_of(extra_info: Any) -> PageKey | None:
    prefix = getattr(extra_info, "prefix_keys", None)
    if not prefix:
        return None
    try:
        return parse_key(prefix[-1])
    except ValueError:
        return None


__all__ = ["KVTierStorage", "check_indices"]
