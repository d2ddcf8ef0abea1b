"""KVTierStorage: SGLang's HiCache L3 backend on the sgl-kvtier page store.

Loaded by SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name":"kvtier","module_path":"sgl_kvtier.sglang","class_name":"KVTierStorage","interface_v1":1,
      "devices":["/mnt/nvme0/kvtier"], "capacity_bytes": 400000000000}'

Lifecycle (``host_shards``): ``cls(storage_config, {})`` checks the SGLang release (``release``:
``UnsupportedSGLangError``) and our keys (``ConfigError`` naming the bad one); either stops start-up.
``register_mem_pool_host`` and ``register_mem_host_pool_v2`` bind every host pool SGLang registers to a host
shard of its own, or refuse it (``UnservedPoolError``, naming it). The KV host shard opens at
``register_mem_pool_host`` (a writer's failed open raises: SGLang refuses to start rather than run without its
L3); ``on_host_pools_registered`` opens the rest, each under its share of the backend's one byte limit
(``capacity``). ``close`` (detach, shutdown, a failed attach) closes every host shard whatever the others
raise and reports the first failure at the boundary; a later backend on the same devices opens them again.

Boundary rule: SGLang calls exists / get / set from three threads, and clear / get_stats / close from its
scheduler; none of these raises. Every exception is caught in ``_guarded``, answered as a miss (``False``
/ 0 / ``None`` / an empty result), counted by ``self.boundary`` (``telemetry().boundary``, and the
``kvtier_boundary_errors`` gauge), and logged at a bounded rate: IO faults and bad arguments
(``EXPECTED_ERRORS``) in one line, anything else (a bug) with its traceback.

Extensions (``Extension``): an opt-in feature rides on a backend without the adapter importing it. A plugin's
``load`` adds a factory to ``EXTENSIONS``; each backend made afterwards carries one of each. ``batch_get_v1``
lets them answer first (``experiments.streaming.backend_side``), ``telemetry().stream`` is theirs, and
``close`` closes them before the stores. With none (the default) a read goes straight to the KV host shard.

State: everything per backend lives on the instance (host shards, transfer figures, error counters, the cost
policy, the metrics feed); the one per-process object is the Prometheus exporter
(``telemetry.prometheus.PROCESS_GAUGES``), because prometheus_client's registry is per process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

import sgl_kvtier
from sgl_kvtier import __version__
from sgl_kvtier.config import Streaming
from sgl_kvtier.errors import KVTierError
from sgl_kvtier.keys import PageKey
from sgl_kvtier.policy.cost_inputs import CostPolicy, ReadPath
from sgl_kvtier.sglang import plugins, release
from sgl_kvtier.sglang.host_pages import check_indices
from sgl_kvtier.sglang.host_shard import HostShard
from sgl_kvtier.sglang.host_shards import KV, HostShards
from sgl_kvtier.sglang.page_keys import keys_or_none, keys_until_invalid, parent_of, prefix_keys, warm_page_hash
from sgl_kvtier.sglang.settings import store_config
from sgl_kvtier.sglang.side_pools import exists_v2
from sgl_kvtier.sglang.stats import TransferStats
from sgl_kvtier.store.lifecycle import Failure, handed_on, weak_method
from sgl_kvtier.telemetry.counters import ErrorBoundary
from sgl_kvtier.telemetry.prometheus import PrometheusFeed
from sgl_kvtier.telemetry.snapshot import RankLabels, StreamSnapshot, TelemetrySnapshot

log = logging.getLogger(__name__)
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (KVTierError, OSError, ValueError, RuntimeError)
T = TypeVar("T")


class Extension(Protocol):
    """An opt-in feature riding on a backend (``experiments.streaming.backend_side.StreamingSide``): the
    adapter calls it through these four methods alone and never imports it. Each call is guarded by the
    backend's boundary: ``answer`` inside ``batch_get_v1``'s guard, the others here."""

    def answer(self, keys: list[PageKey | None], host_indices: torch.Tensor) -> list[bool] | None:
        """The read of these slots if the extension answers it itself, else None (read them as usual)."""

    def pools_registered(self) -> None:
        """Every host pool is known (say once what stays off)."""

    def snapshot(self) -> StreamSnapshot | None:
        """Its figures for ``telemetry()`` (None: nothing to report)."""

    def close(self) -> None:
        """Release what it holds; called before the stores close."""


# Made per backend at construction, in order: filled by plugins' ``load`` (``KVTIER_STREAM=1``), empty otherwise.
EXTENSIONS: list[Callable[[KVTierStorage], Extension]] = []


class KVTierStorage(HiCacheStorage):  # type: ignore[misc, unused-ignore]  # SGLang ships no type information
    """SGLang's L3 storage backend: one host shard (a page-store shard) per registered host pool, on NVMe.

    KV moves zero-copy between the host pool and flash through the v1 calls (``interface_v1``); the
    legacy flat-tensor calls and the v2 side-pool calls are served too. ``telemetry()`` is the one
    typed view of its state; ``cost_inputs()`` the cost policy's measured inputs, JSON-ready.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        sglang_release = release.check_supported()
        self.storage_config = storage_config
        self.config = store_config(storage_config.extra_config)
        self.writer = release.writer_of(storage_config)
        self.host_shards = HostShards(storage_config, self.config, self.writer)
        self.stats = TransferStats(enabled=True)
        self.boundary = ErrorBoundary(log, EXPECTED_ERRORS)
        # (parts call back weakly: no reference cycle, store.lifecycle; a closed backend goes by refcounting alone)
        self.cost = CostPolicy(weak_method(self._read_path, None), boundary=self.boundary)
        self._metrics = PrometheusFeed(bool(storage_config.enable_storage_metrics), self.boundary)
        self._said_streaming = False
        self.extensions: tuple[Extension, ...] = tuple(make(self) for make in EXTENSIONS)
        warm_page_hash()
        log.info("kvtier: sgl-kvtier %s (%s) on SGLang %s, rank tp%d pp%d, devices %s", __version__,
                 sgl_kvtier.__path__[0], sglang_release, storage_config.tp_rank, storage_config.pp_rank,
                 list(self.config.devices))

    @property
    def shards(self) -> dict[str, HostShard]:
        """The shard serving each registered host pool, by pool name (``kv``: the KV pool's)."""
        return self.host_shards.by_name

    @property
    def kv(self) -> HostShard | None:
        """The KV pool's host shard (None before ``register_mem_pool_host`` and after ``close``)."""
        return self.host_shards.kv

    # ------------------------------------------------------------------ registration (errors stop start-up)
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV host pool (host shard ``kv``): it opens now (errors stop start-up; on raw block devices it
        waits for the others), and under its final share of the capacity once every side pool is known
        (``on_host_pools_registered``)."""
        super().register_mem_pool_host(mem_pool_host)
        self.host_shards.register(KV, mem_pool_host, open_now=True)
        self._say_streaming()

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Every pool of SGLang's ``HostPoolGroup``: served by a host shard of its own (the KV pool by ``kv``),
        or refused with ``UnservedPoolError`` naming it. A pool registered after the host shards opened
        reopens them under new capacity shares."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.host_shards.register(str(getattr(host_pool_name, "value", host_pool_name)), host_pool)

    def on_host_pools_registered(self) -> None:
        """All pools are known: open every host shard under its share of the capacity. (SGLang 0.5.23 calls
        it; 0.5.22 does not, and the first call that needs a store opens them, ``HostShards.ready``.)"""
        parent = getattr(super(), "on_host_pools_registered", None)  # absent on SGLang 0.5.22
        if parent is not None:
            parent()
        self.host_shards.open_all()
        self._say_streaming()

    # ------------------------------------------------------------------ extensions
    def _say_streaming(self) -> None:
        """Once the pools are known: each extension says what stays off; with ``streaming = "on"`` and no
        streaming extension in this process (the stream plugin is off), one line says why hits load whole."""
        for ext in self.extensions:
            self._guarded("extension (pools registered)", ext.pools_registered, lambda: None)
        if self._said_streaming or self.config.streaming is not Streaming.ON or self.kv is None or self.extensions:
            return
        why = plugins.why_off("stream")
        if not why:  # the plugin is on: its side says what stays off
            return
        self._said_streaming = True
        log.warning("kvtier: streaming = \"on\" but L3 hits will load whole, as with \"off\": %s", why)

    # ------------------------------------------------------------------ v1: zero-copy KV
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading pages of ``keys`` stored (with the cost policy on: worth loading); their reads start now."""
        return self._guarded("batch_exists", lambda: self._exists(keys, extra_info), lambda: 0)

    def _exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None) -> int:
        parsed = keys_until_invalid(keys)
        shard = self._kv()
        hit = shard.longest_prefix(parsed)
        # With KVTIER_PREFETCH_POLICY=cost: only the leading pages predicted to load faster than recompute.
        hit = self.cost.shorten_hit(len(keys), hit, len(prefix_keys(extra_info)))
        try:
            shard.stage(parsed[:hit])  # read-ahead: the reads start now, batch_get_v1 collects them
        except Exception as exc:  # the hit stands: batch_get_v1 reads on demand
            self.boundary.fail("batch_exists read-ahead", exc, outcome="read on demand")
        return hit

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read the leading stored run of ``keys`` into the host pool slots ``host_indices``."""
        def get() -> list[bool]:
            start = time.perf_counter()
            shard = self._kv()
            parsed = keys_or_none(keys)
            for ext in self.extensions:  # none unless a plugin added one (a streamed hit's head, at once)
                answer = ext.answer(parsed, host_indices)
                if answer is not None:
                    return answer
            result = shard.read(parsed, host_indices)
            self.stats.record_get(sum(result), shard.pages.page_bytes, time.perf_counter() - start)
            return result

        return self._guarded("batch_get_v1", get, lambda: [False] * len(keys))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Write the pages at ``host_indices`` under ``keys`` (non-writer ranks: acknowledged, not written)."""
        if not self.writer:
            return [True] * len(keys)  # another rank writes this replicated shard

        def put() -> list[bool]:
            start = time.perf_counter()
            shard = self._kv()
            result = shard.write(keys_or_none(keys), host_indices, parent_of(extra_info))
            self.stats.record_set(sum(result), shard.pages.page_bytes, time.perf_counter() - start)
            return result

        return self._guarded("batch_set_v1", put, lambda: [False] * len(keys))

    # ------------------------------------------------------------------ legacy: flat page tensors
    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored (a presence check, not a load decision: the cost policy is not asked)."""
        return self._guarded("exists", lambda: self._kv().longest_prefix(keys_until_invalid([key])) == 1,
                             lambda: False)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """One flat page into ``target_location`` (or a fresh one); None on a miss."""
        page: torch.Tensor | None = self.batch_get([key], [target_location])[0]
        return page

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Flat pages into ``target_locations`` (or fresh ones); None for each miss."""
        def get() -> list[Any]:
            shard = self._kv()
            given = [None] * len(keys) if target_locations is None else list(target_locations)
            targets = [shard.pages.pool.get_dummy_flat_data_page() if t is None else t for t in given]
            oks = shard.read_flat(keys_or_none(keys), targets)
            return [t if ok else None for t, ok in zip(targets, oks)]

        return self._guarded("batch_get", get, lambda: [None] * len(keys))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat page."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages; True only if every one was stored (non-writer ranks: True, nothing written)."""
        if not self.writer:
            return True
        return self._guarded("batch_set", lambda: all(self._kv().write_flat(keys_or_none(keys), list(values))),
                             lambda: False)

    # ------------------------------------------------------------------ v2: side pools
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable KV prefix given every side pool's hit policy (see ``side_pools``)."""
        def exists() -> PoolTransferResult:
            return exists_v2(self._kv(), self.shards, keys_until_invalid(keys), pool_transfers or [])

        return self._guarded("batch_exists_v2", exists, PoolTransferResult.empty)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Read each side pool's pages; per pool, one flag per key."""
        return {str(t.name): self._transfer(t, write=False, extra_info=extra_info) for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Write each side pool's pages; per pool, one flag per key."""
        return {str(t.name): self._transfer(t, write=True, extra_info=extra_info) for t in transfers}

    def _transfer(self, t: PoolTransfer, write: bool, extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        """One side pool's read or write through its host shard, guarded; one flag per key."""
        keys = list(t.keys or [])

        def move() -> list[bool]:
            self.host_shards.ready()
            shard = self.shards.get(str(getattr(t.name, "value", t.name)))
            if shard is None:
                raise KVTierError(f"no host pool {t.name!r} registered")
            if not write:
                return shard.read(keys_or_none(keys), t.host_indices)
            if not self.writer:
                return [True] * len(keys)
            return shard.write(keys_or_none(keys), t.host_indices, parent_of(extra_info))

        return self._guarded(f"batch_{'set' if write else 'get'}_v2[{t.name}]", move, lambda: [False] * len(keys))

    # ------------------------------------------------------------------ admin
    def clear(self) -> None:
        """Drop every page of every host shard this rank writes."""
        def drop() -> None:
            self.host_shards.ready()
            for shard in list(self.shards.values()):
                self._guarded("clear", shard.clear, lambda: None)  # each host shard whatever the others raise

        self._guarded("clear", drop, lambda: None)

    def get_stats(self) -> StorageMetrics | None:
        """SGLang's per-op transfer figures since the last call (drained); refreshes the ``kvtier_`` gauges
        at most once per ``KVTIER_METRICS_INTERVAL_S``."""
        def drain() -> StorageMetrics | None:
            self._metrics.refresh(self.telemetry)  # never raises: a failed refresh is counted and logged
            return self.stats.drain()

        return self._guarded("get_stats", drain, lambda: None)

    def telemetry(self) -> TelemetrySnapshot:
        """Everything this backend reports, typed and immutable: per pool the store and read-ahead figures,
        the prefill model, the policy switch, the boundary's counters, the rank labels, and its streamed
        tails when it streams."""
        cfg = self.storage_config
        shards = list(self.shards.values())
        return TelemetrySnapshot(
            ranks=RankLabels(int(cfg.tp_rank or 0), int(cfg.pp_rank or 0), int(cfg.dp_rank or 0)),
            pools=tuple(s.snapshot() for s in shards), prefill=self.cost.prefill.snapshot(),
            cost_policy_enabled=self.cost.enabled(), boundary=self.boundary.counts(), stream=self._stream())

    def _stream(self) -> StreamSnapshot | None:
        """The first extension's streaming figures (None: no extension reports any)."""
        for ext in self.extensions:
            snap = self._guarded("telemetry (extension)", ext.snapshot, lambda: None)
            if snap is not None:
                return snap
        return None

    def cost_inputs(self) -> dict[str, Any]:
        """The cost policy's measured inputs: read bandwidth / batch latency per pool and device, prefill speed."""
        return self.telemetry().cost_inputs()

    def close(self) -> None:
        """Close the extensions, then every host shard (its read-ahead, then its store), each whatever the
        others raise (detach, shutdown, a failed attach). Never raises into SGLang: once all is released, the
        first failure is counted and logged at the boundary, the later ones as its notes. Idempotent. A closed
        backend holds no host pool (and, by the no-cycles rule of ``store.lifecycle``, nothing it held outlives
        its last reference): whoever still holds it keeps no host memory alive."""
        for ext in self.extensions:  # first: a streamed tail reads the stores
            try:
                ext.close()
            except Exception as exc:  # the stores are closed whatever an extension raised
                self.boundary.fail("close (extension)", exc, outcome="the stores closed anyway")
        for held in ("mem_pool_host", "registered_pools"):  # HiCacheStorage's own references to the host pools
            self.__dict__.pop(held, None)
        failures = self.host_shards.close()
        if failures:  # handed on, not kept here: this frame is in their tracebacks (lifecycle.handed_on)
            self._report_close(handed_on(failures))

    def _report_close(self, failures: list[Failure]) -> None:
        """Count and log the first close failure, the others as its notes; re-raise an interrupt."""
        step, first = failures[0]
        for later, exc in failures[1:]:
            first.add_note(f"{later} also failed: {exc!r}")
            log.warning("kvtier close: %s also failed: %s", later, repr(exc))  # (a string: no error kept)
        if isinstance(first, Exception):
            self.boundary.fail(f"close ({step})", first, outcome="everything else released")
        interrupt = next((exc for _, exc in failures if not isinstance(exc, Exception)), None)
        if interrupt is not None:
            raise interrupt  # a KeyboardInterrupt / SystemExit is never swallowed; everything was released first

    # ------------------------------------------------------------------ internals
    def _read_path(self) -> ReadPath | None:
        """The KV host shard's measured read path for the cost policy (None: not open or not measured yet)."""
        shard = self.kv
        store = None if shard is None else shard.store
        model = None if store is None else store.read_rates.model()
        if shard is None or model is None:
            return None
        return ReadPath(shard.pages.page_tokens, shard.pages.page_bytes, model)

    def _kv(self) -> HostShard:
        """The KV host shard, opening the host shards if nobody did; ``KVTierError`` when there is none."""
        self.host_shards.ready()
        kv = self.kv
        if kv is None:
            raise KVTierError("no KV host pool registered (or the backend is closed)")
        return kv

    def _guarded(self, op: str, call: Callable[[], T], miss: Callable[[], T]) -> T:
        """``call()``, or on any exception: count and log it, and answer ``miss()``."""
        try:
            return call()
        except Exception as exc:  # the boundary: nothing raises into SGLang's threads
            self.boundary.fail(op, exc)
            return miss()


__all__ = ["KVTierStorage", "EXPECTED_ERRORS", "check_indices", "warm_page_hash"]
