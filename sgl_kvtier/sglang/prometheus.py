"""Prometheus gauges of the L3 tier, in SGLang's own ``/metrics`` (``--enable-metrics``).

SGLang runs ``prometheus_client`` in multiprocess mode: the launcher sets ``PROMETHEUS_MULTIPROC_DIR``
before it spawns the scheduler processes, every process writes its samples to files there, and the
HTTP server's ``/metrics`` merges them (``MultiProcessCollector``). Our backend lives in a scheduler
process, so gauges created there (``multiprocess_mode="mostrecent"``, as SGLang's own gauges are) appear
in that ``/metrics`` without an endpoint of our own.

What is exported (all ``kvtier_``; labels ``pool`` and the ranks ``tp_rank``, ``pp_rank``, ``dp_rank``,
plus ``device`` (index) and ``path`` for per-device series):
- the cost policy's measured inputs: read bandwidth, batch latency and sample count, all devices together
  (what a load sees) and per device; the prefill model (``per_token_s``, ``per_token_kctx_s``,
  ``fixed_s``, samples); whether the policy is on;
- the store: pages, bytes used, capacity bytes, each ``StoreCounters`` field as a gauge of its running
  total (``kvtier_store_<field>``), and per device the circuit breaker (0 closed, 0.5 half open: probing,
  1 open) and how often it tripped.

Fed by ``update(backend)``: from ``KVTierStorage.get_stats`` (SGLang calls it on every scheduler step,
and only with ``--enable-metrics``: ``UnifiedRadixCache.check_hicache_events``) and from the cost
plugin's per-batch hook. Whatever calls it, gauges are refreshed at most once per
``KVTIER_METRICS_INTERVAL_S`` seconds (default 1) per process: a step in between costs one clock read.

Invariants:
- Inert unless ``PROMETHEUS_MULTIPROC_DIR`` is set and the backend's storage config has metrics on:
  then ``prometheus_client`` is not even imported, no gauge exists, no file is written.
- Never raises into SGLang: a failure is logged at a bounded rate and the next refresh tries again; if
  the gauges cannot be created at all, exporting stays off in this process.
- A figure not measured yet (an estimator without a fit) has no series: never a made-up 0.
- Label sets differ between ranks, so merging the processes' files never mixes two ranks' values.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from typing import Any

from sgl_kvtier.metrics import RateLimitedLog, StoreCounters
from sgl_kvtier.prefetch import ReadAheadCounters
from sgl_kvtier.sglang import throughput

log = logging.getLogger(__name__)

ENV_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
ENV_INTERVAL = "KVTIER_METRICS_INTERVAL_S"
DEFAULT_INTERVAL_S = 1.0
RANKS = ("tp_rank", "pp_rank", "dp_rank")
POOL = ("pool", *RANKS)
DEVICE = (*POOL, "device", "path")
BREAKER_VALUE = {"closed": 0.0, "half_open": 0.5, "open": 1.0}
COUNTERS = tuple(f.name for f in dataclasses.fields(StoreCounters))
READAHEAD = tuple(f.name for f in dataclasses.fields(ReadAheadCounters))

# name, help, labels
_GAUGES = (
    ("read_bandwidth_bytes_per_second", "Read bandwidth of the pool's store, all devices (batch wall clock)", POOL),
    ("read_batch_latency_seconds", "Fixed cost per read batch of the pool's store, all devices", POOL),
    ("read_samples", "Read batches the pool's read model was fitted on", POOL),
    ("device_read_bandwidth_bytes_per_second", "Read bandwidth of one device (its own ops' time)", DEVICE),
    ("device_read_batch_latency_seconds", "Fixed cost per read batch of one device", DEVICE),
    ("device_breaker_state", "Circuit breaker of one device: 0 closed, 0.5 half open, 1 open", DEVICE),
    ("device_breaker_trips", "Times the device's circuit breaker opened since the store opened", DEVICE),
    ("store_pages", "Pages stored in the pool's shard", POOL),
    ("store_bytes_used", "Bytes of device slots holding pages", POOL),
    ("store_capacity_bytes", "Byte limit of the pool's shard", POOL),
    *((f"store_{c}", f"StoreCounters.{c}: running total since the store opened", POOL) for c in COUNTERS),
    *((f"readahead_{c}", f"ReadAheadCounters.{c}: pages, running total since the store opened", POOL)
      for c in READAHEAD),
    ("readahead_buffers_in_use", "Read-ahead staging buffers (one page each) held now", POOL),
    ("prefill_per_token_seconds", "Prefill model: seconds per new token", RANKS),
    ("prefill_per_token_kctx_seconds", "Prefill model: seconds per new token per 1000 tokens of attention span",
     RANKS),
    ("prefill_fixed_seconds", "Prefill model: fixed seconds per batch", RANKS),
    ("prefill_samples", "Prefill batches the prefill model was fitted on", RANKS),
    ("cost_policy_enabled", "1 when KVTIER_PREFETCH_POLICY=cost (load or recompute by the cost model)", RANKS),
)


class Exporter:
    """The gauges, in ``registry`` (None: prometheus_client's default, which SGLang's /metrics merges)."""

    def __init__(self, registry: Any = None):
        from prometheus_client import Gauge

        where = {} if registry is None else {"registry": registry}
        self.gauges = {name: Gauge(f"kvtier_{name}", doc, labelnames=labels, multiprocess_mode="mostrecent", **where)
                       for name, doc, labels in _GAUGES}

    def _set(self, name: str, labels: tuple, value: Any) -> None:
        if value is None:
            return  # not measured yet: no series rather than a made-up number
        self.gauges[name].labels(*map(str, labels)).set(float(value))

    def update(self, backend: Any) -> None:
        ranks = rank_labels(backend)
        for name, tier in dict(getattr(backend, "tiers", {}) or {}).items():
            store = getattr(tier, "store", None)
            if store is not None:
                self._update_store((name, *ranks), store)
            readahead = getattr(tier, "readahead", None)
            if readahead is not None:
                snap = readahead.snapshot()
                for c in (*READAHEAD, "buffers_in_use"):
                    self._set(f"readahead_{c}", (name, *ranks), snap[c])
        prefill = throughput.PREFILL.snapshot()
        self._set("prefill_per_token_seconds", ranks, prefill["per_token_s"])
        self._set("prefill_per_token_kctx_seconds", ranks, prefill["per_token_kctx_s"])
        self._set("prefill_fixed_seconds", ranks, prefill["fixed_s"])
        self._set("prefill_samples", ranks, prefill["samples"])
        self._set("cost_policy_enabled", ranks, throughput.policy_enabled())

    def _update_store(self, pool: tuple, store: Any) -> None:
        stats = store.stats()
        self._set("store_pages", pool, stats.pages)
        self._set("store_bytes_used", pool, stats.bytes_used)
        self._set("store_capacity_bytes", pool, stats.capacity_bytes)
        for c in COUNTERS:
            self._set(f"store_{c}", pool, stats.counters.get(c))
        rates = store.read_rates
        total = rates.total.snapshot()
        self._set("read_bandwidth_bytes_per_second", pool, total["bandwidth_Bps"])
        self._set("read_batch_latency_seconds", pool, total["batch_latency_s"])
        self._set("read_samples", pool, total["samples"])
        for i, (health, est) in enumerate(zip(store.health.summary(), rates.devices)):
            device = (*pool, i, health["device"])
            snap = est.snapshot()
            self._set("device_read_bandwidth_bytes_per_second", device, snap["bandwidth_Bps"])
            self._set("device_read_batch_latency_seconds", device, snap["batch_latency_s"])
            self._set("device_breaker_state", device, BREAKER_VALUE.get(health["state"], 1.0))
            self._set("device_breaker_trips", device, health["trips"])


def rank_labels(backend: Any) -> tuple[int, int, int]:
    cfg = getattr(backend, "storage_config", None)
    return tuple(int(getattr(cfg, r, 0) or 0) for r in RANKS)  # type: ignore[return-value]


def exporting(backend: Any) -> bool:
    """SGLang serves multiprocess metrics and this backend's storage config has metrics on."""
    cfg = getattr(backend, "storage_config", None)
    return bool(os.environ.get(ENV_MULTIPROC_DIR)) and bool(getattr(cfg, "enable_storage_metrics", False))


def _interval() -> float:
    raw = os.environ.get(ENV_INTERVAL, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        value = math.nan
    if not value >= 0:
        log.warning("%s=%r is not a number of seconds >= 0; using %.1f", ENV_INTERVAL, raw, DEFAULT_INTERVAL_S)
        return DEFAULT_INTERVAL_S
    return value


_lock = threading.Lock()
_exporter: Exporter | None = None
_broken = False  # the gauges could not be created: exporting stays off in this process
_interval_s: float | None = None
_next = -math.inf
_errlog = RateLimitedLog(log)


def update(backend: Any, now: float | None = None) -> bool:
    """Refresh the gauges from ``backend`` if the interval has passed; True when they were refreshed.

    Cheap between refreshes (one clock read); never raises.
    """
    global _exporter, _broken, _interval_s, _next
    if backend is None or _broken:
        return False
    t = time.monotonic() if now is None else now
    if t < _next:
        return False
    try:
        with _lock:
            if t < _next:
                return False
            if _interval_s is None:
                _interval_s = _interval()
            _next = t + _interval_s
            if not exporting(backend):
                return False
            if _exporter is None:
                try:
                    _exporter = Exporter()
                except Exception as exc:  # noqa: BLE001 - e.g. names already registered by another exporter
                    _broken = True
                    log.warning("kvtier: Prometheus gauges off in pid %d: %s: %s", os.getpid(), type(exc).__name__, exc)
                    return False
            _exporter.update(backend)
        return True
    except Exception as exc:  # noqa: BLE001 - a refresh must never break the scheduler step calling it
        _errlog.error("kvtier: Prometheus gauges not refreshed: %s: %s", type(exc).__name__, exc)
        return False


def reset() -> None:
    """Forget the rate limit and the interval read from the environment (tests)."""
    global _interval_s, _next
    with _lock:
        _interval_s, _next = None, -math.inf
