"""Prometheus gauges of the L3 tier, in SGLang's own ``/metrics`` (``--enable-metrics``).

SGLang runs ``prometheus_client`` in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``), so gauges our backend
makes in a scheduler process (``multiprocess_mode="mostrecent"``) appear there with no endpoint of ours.
All are ``kvtier_``, labelled ``pool`` and ranks (``tp_rank``, ``pp_rank``, ``dp_rank``): the cost policy's
inputs, the store (``kvtier_store_<StoreCounters field>``, per device (``device``, ``path``) its read rate
and breaker: 0 closed, 0.5 half open, 1 open), read-ahead, the shared pool (plus ``namespace``: its cap,
writers by state, sharing counters, and per ``wid``/``host`` pages, bytes, lease ages and ``live``), caught
exceptions by kind, and, only when the backend streams, its ``kvtier_stream_*`` counters (``_s`` fields as
``_seconds``) and learned bind figures. Per-writer series carry no state label, so a dying writer leaves no
stale series in the multiprocess files; a writer gone from the pool shows ``retired`` (live 0, no pages)
for a minute, then keeps those values until the process restarts. Every gauge's help says what it measures (a
running total's from a meaning per field: ``STORE_HELP``, ``READAHEAD_HELP``, ``STREAM_HELP``) and ``LABEL_HELP``
what each label means; the metrics reference of the documentation site is generated from these definitions.

``PrometheusFeed.refresh`` is called from ``KVTierStorage.get_stats`` (every scheduler step with
``--enable-metrics``, from SGLang's ``check_hicache_events``) and refreshes at most once per
``KVTIER_METRICS_INTERVAL_S`` (default 1 s).

Invariants: inert (``prometheus_client`` not imported, no file written) unless ``PROMETHEUS_MULTIPROC_DIR``
is set and the storage config has metrics on; one ``Exporter`` per process (the default registry takes a
name once), exporting off if it cannot be made; never raises into SGLang (a failed refresh is counted by the
backend's ``ErrorBoundary`` and retried next interval); a figure not measured yet has no series, never a
made-up 0; label sets keep ranks apart when merged.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from sgl_kvtier.telemetry.counters import ErrorBoundary, ErrorKind, StoreCounters
from sgl_kvtier.telemetry.snapshot import (
    SHARING_COUNTERS,
    Breaker,
    StoreSnapshot,
    StreamHookSnapshot,
    StreamSnapshot,
    TelemetrySnapshot,
    WriterState,
)

log = logging.getLogger(__name__)

ENV_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
ENV_INTERVAL = "KVTIER_METRICS_INTERVAL_S"
DEFAULT_INTERVAL_S = 1.0
RANKS = ("tp_rank", "pp_rank", "dp_rank")
POOL = ("pool", *RANKS)
DEVICE = (*POOL, "device", "path")
SHARED = (*POOL, "namespace")
WRITER = (*SHARED, "wid", "host")
BREAKER_VALUE = {Breaker.CLOSED: 0.0, Breaker.HALF_OPEN: 0.5, Breaker.OPEN: 1.0}
COUNTERS = tuple(f.name for f in dataclasses.fields(StoreCounters))
# The fields of ``prefetch.ReadAheadCounters`` (a higher layer: named here, checked equal by the tests).
READAHEAD = ("staged", "served", "joined", "failed", "dropped", "skipped_full")
REASON = (*RANKS, "reason")
# What each label means (the metrics reference prints it; a label without one fails the tests).
LABEL_HELP = {
    "pool": "The host pool the store serves: kv (the KV cache), or a side pool of a hybrid model by its SGLang name",
    "tp_rank": "Tensor-parallel rank of the SGLang process",
    "pp_rank": "Pipeline-parallel rank of the SGLang process",
    "dp_rank": "Data-parallel rank of the SGLang process",
    "device": "Index of the device in the devices list (striping order)",
    "path": "The device's path, as configured",
    "namespace": "The namespace shard's digest (hex): its ns-<digest> directory",
    "state": "A writer's state as this process judges it: live, dead, retired or unknown",
    "wid": "A writer's id, <host_id>-<k> (its directory is w-<wid>)",
    "host": "The host a writer runs on (its host_id)",
    "kind": "How a caught exception is classed: expected (an IO fault, bad input) or unexpected (a bug)",
    "reason": "Why the stream plugin gave a tail up or did not stream a hit, as it names it",
}


def _stream_gauge(field: str) -> str:
    """The gauge of a stream snapshot field: ``stream_<field>``, a ``_s`` field in ``_seconds``."""
    return f"stream_{field[:-2]}_seconds" if field.endswith("_s") else f"stream_{field}"


# The numeric fields of the stream snapshots (the by-reason mappings and ``hooks`` are exported apart).
STREAM_READS = tuple(f.name for f in dataclasses.fields(StreamSnapshot) if f.name not in ("hooks", "bind"))
# The bind rule's learned figures: StreamBindSnapshot field -> (gauge, help).
STREAM_BIND = {
    "whole_wait_fixed_s": ("stream_bind_whole_wait_fixed_seconds",
                           "Bind rule: fixed seconds of an L3 hit loaded whole (fitted on hits loaded whole alone)"),
    "whole_wait_s_per_mb": ("stream_bind_whole_wait_seconds_per_megabyte",
                            "Bind rule: seconds per MB of an L3 hit loaded whole (the same fit)"),
    "whole_samples": ("stream_bind_whole_samples", "Bind rule: hits loaded whole alone that the wait was fitted on"),
    "interference_s_per_mb": ("stream_bind_interference_seconds_per_megabyte",
                              "Bind rule: seconds a forward ran over the prefill model per MB of streamed tail"),
    "interference_samples": ("stream_bind_interference_samples",
                             "Bind rule: forwards with streamed tails (not stalled) the interference was fitted on"),
    "load_back_fixed_s": ("stream_bind_load_back_fixed_seconds",
                          "Bind rule: fixed seconds of SGLang's host -> device load-back before a forward"),
    "load_back_s_per_mb": ("stream_bind_load_back_seconds_per_megabyte",
                           "Bind rule: seconds per MB of SGLang's host -> device load-back before a forward"),
    "load_back_samples": ("stream_bind_load_back_samples", "Bind rule: load-backs the copy time was fitted on"),
    "measured_whole_s_per_mb": ("stream_bind_measured_whole_seconds_per_megabyte",
                                "Bind rule: an L3 hit loaded whole, its request's time over compute per MB"),
    "measured_whole_hits": ("stream_bind_measured_whole_hits", "Bind rule: hits loaded whole timed end to end"),
    "measured_stream_s_per_mb": ("stream_bind_measured_stream_seconds_per_megabyte",
                                 "Bind rule: a streamed L3 hit, its request's time over compute per MB"),
    "measured_stream_hits": ("stream_bind_measured_stream_hits", "Bind rule: streamed hits timed end to end"),
}
STREAM_HOOKS = tuple(f.name for f in dataclasses.fields(StreamHookSnapshot) if f.name not in ("dropped", "not_streamed"))

# What each running-total field means: the help of its gauge (a field without one fails at import, and in the tests).
STORE_HELP = {
    "put_pages": "Pages written",
    "put_present": "Offered pages already stored (or being stored): skipped",
    "put_declined": "Offered pages the admission filter turned away (admission_threshold)",
    "put_no_space": "Pages refused because nothing could be evicted",
    "get_hits": "Pages asked for, found and read back verified",
    "get_misses": "Pages asked for and not served (not stored, unreadable, corrupt, or their device's breaker open)",
    "corrupt_pages": "Pages that failed their checksum or came back short: dropped, served as misses",
    "remote_reuse_races": "Another writer's pages whose slot its owner reused under the read: served as misses",
    "segments_reopened": "Another writer's segment files opened afresh after a page read through the old "
                         "descriptor failed verification, or failed as lost (its filesystem's client died)",
    "fresh_rereads": "Another writer's pages that failed through an old descriptor and verified through a fresh "
                     "one (served)",
    "io_errors": "Failed IOs: reads, writes, fdatasyncs and segment growths that the devices refused",
    "evictions": "Pages evicted to make room (capacity or pool quota)",
    "bad_requests": "Requests with a wrong key length or page size: refused",
    "bytes_written": "Page bytes written (the pages' own size, per page stored)",
    "bytes_read": "Page bytes read back for hits (the pages' own size, per hit)",
    "parts_read": "Parts of pages read group-major (layer group by layer group) and verified",
    "parts_failed": "Parts read group-major whose IO failed, came short or failed their checksum",
}
READAHEAD_HELP = {
    "staged": "Pages whose read an exists query started into the read-ahead staging area",
    "served": "Pages a get took from the staging area",
    "joined": "Pages a get took from the staging area while their read was still in flight",
    "failed": "Staged reads that failed (read again on demand)",
    "dropped": "Staged pages never asked for (stale, or at close)",
    "skipped_full": "Pages not staged because the staging budget (readahead_bytes) was in use",
}
STREAM_HELP = {
    # the backend's tail streams (StreamSnapshot)
    "bound_hits": "L3 hits bound to a tail stream",
    "read_groups": "Read groups of the bound hits, summed",
    "head_pages": "Pages answered present to SGLang's IO thread from a stream (inserted as usual)",
    "streamed_pages": "Pages tail streams landed whole and verified",
    "staged_pages": "Streamed pages copied from the read-ahead staging area",
    "failed_pages": "Pages of streams that did not land (cancelled streams not counted)",
    "failed_groups": "(stream, layer group) reads that did not land on every page of the stream",
    "cancelled": "Streams cancelled (released slots, a dropped tail, close)",
    "read_errors": "Streams whose read raised",
    "withheld_pages": "Released pages kept back until their stream ended (then freed)",
    "mismatches": "Answers or binds that found a stream where none was expected (bugs)",
    # the stream plugin in this process (StreamHookSnapshot)
    "bind_calls": "Hits handed to the backend to bind to a stream (it may decline)",
    "tails": "Tails registered: the part of a hit not landed at its admission",
    "ready": "Tails the admission gate let through",
    "admitted": "Tails loaded back into private device slots with their request",
    "gate_waits": "Admission polls the gate answered not yet",
    "gate_wait_s": "Seconds from registration to ready, summed over the tails let through",
    "withheld_registered_slots": "Slots of registered tails SGLang tried to release (kept back; a bug)",
    "loads": "Forward batches with streamed tails",
    "loaded_tails": "Streamed tails loaded by forward batches",
    "copied_layers": "(tail, layer) copies of verified bytes",
    "zeroed_layers": "(tail, layer) zero fills",
    "zero_filled_groups": "Layer groups the loader filled with zeros (failed, late, a failed copy, injected)",
    "timeouts": "Zero-filled layer groups whose deadline passed",
    "landed": "Tails whose rank-agreed verdict was landed: kept",
    "poisoned": "Tails whose verdict was a failure: their request retracted (or aborted)",
    "stalls": "Forward reads that waited for a tail layer still loading",
    "stall_s": "Seconds forward reads waited for tail layers still loading",
    "retracts": "Requests retracted after a forward (output dropped, KV released, recomputed)",
    "requeued": "Retracted requests put back in the waiting queue",
    "aborted": "Requests that could not be retracted and were aborted instead (503)",
}

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
    *((f"store_{c}", f"{STORE_HELP[c]} (running total since the store opened)", POOL) for c in COUNTERS),
    *((f"readahead_{c}", f"Read-ahead: {READAHEAD_HELP[c]} (running total since the store opened)", POOL)
      for c in READAHEAD),
    ("pool_bytes_used", "Bytes the shared pool's cap counts: own pages + the other writers' leased bytes", SHARED),
    ("pool_capacity_bytes", "Pool-wide byte cap of the namespace shard, over all its writers", SHARED),
    ("pool_writers", "Writers of the shared pool by state (live, dead, retired, unknown), as this process judges them",
     (*SHARED, "state")),
    ("pool_peers_dropped", "Other writers this pool stopped reading (retired, or their directory removed or made "
     "anew): running total since the pool opened", SHARED),
    ("pool_writers_retired", "Writers of other hosts this pool's writer retired (fence, then files): running "
     "total", SHARED),
    ("pool_fenced_pages", "Pages refused because this pool's own writer was fenced (retired by another host, "
     "or its descriptors lost): running total", SHARED),
    ("pool_reregistrations", "Times this pool's own writer, once fenced, re-registered in a fresh directory: "
     "running total", SHARED),
    ("writer_pages", "Pages of one writer of the pool (another writer's: its last lease)", WRITER),
    ("writer_bytes_used", "Bytes of one writer of the pool (another writer's: its last lease)", WRITER),
    ("writer_lease_age_seconds", "Seconds since one writer's last lease beat (another's: its LEASE mtime)", WRITER),
    ("writer_live", "1: the writer is alive (its LOCK held; another host's: its lease advancing), 0: dead or "
     "retired; no series while unknown", WRITER),
    ("writer_lease_unchanged_seconds", "Another host's writer: seconds this process has seen its lease counter "
     "unchanged (its own clock; dead at dead_after_s)", WRITER),
    ("readahead_buffers_in_use", "Read-ahead staging buffers (one page each) held now", POOL),
    ("prefill_per_token_seconds", "Prefill model: seconds per new token", RANKS),
    ("prefill_per_token_kctx_seconds", "Prefill model: seconds per new token per 1000 tokens of attention span",
     RANKS),
    ("prefill_fixed_seconds", "Prefill model: fixed seconds per batch", RANKS),
    ("prefill_samples", "Prefill batches the prefill model was fitted on", RANKS),
    ("cost_policy_enabled", "1 when KVTIER_PREFETCH_POLICY=cost (load or recompute by the cost model)", RANKS),
    ("boundary_errors", "Exceptions the adapter caught and served as misses: expected (faults, bad input) or "
     "unexpected (bugs, logged with a traceback)", (*RANKS, "kind")),
    ("streaming_enabled", "1 when the backend streams its L3 hits' tails (streaming = \"on\" on a layout that "
     "streams)", RANKS),
    *((_stream_gauge(f), f"Streamed tails, the backend's reads: {STREAM_HELP[f]} (running total)", RANKS)
      for f in STREAM_READS),
    *((_stream_gauge(f), f"Streamed tails, the stream plugin in this process: {STREAM_HELP[f]} (running total)", RANKS)
      for f in STREAM_HOOKS),
    *((gauge, text, RANKS) for gauge, text in STREAM_BIND.values()),
    ("stream_dropped", "Streamed tails given up before their forward (the request computed them), by reason: "
     "running total", REASON),
    ("stream_not_streamed", "Hits whose unlanded part was not registered as a streamed tail (loaded as today), "
     "by reason: running total", REASON),
)


class Exporter:
    """The gauges, in ``registry`` (None: prometheus_client's default, which SGLang's /metrics merges)."""

    def __init__(self, registry: Any = None):
        from prometheus_client import Gauge

        where = {} if registry is None else {"registry": registry}
        self.gauges = {name: Gauge(f"kvtier_{name}", doc, labelnames=labels, multiprocess_mode="mostrecent", **where)
                       for name, doc, labels in _GAUGES}

    def _set(self, name: str, labels: tuple[object, ...], value: float | int | bool | None) -> None:
        if value is None:
            return  # not measured yet: no series rather than a made-up number
        self.gauges[name].labels(*map(str, labels)).set(float(value))

    def update(self, snap: TelemetrySnapshot) -> None:
        """Set every gauge from one snapshot."""
        ranks = (snap.ranks.tp_rank, snap.ranks.pp_rank, snap.ranks.dp_rank)
        for pool in snap.pools:
            labels = (pool.name, *ranks)
            if pool.store is not None:
                self._update_store(labels, pool.store)
            if pool.readahead is not None:
                for c in READAHEAD:
                    self._set(f"readahead_{c}", labels, pool.readahead.counters.get(c))
                self._set("readahead_buffers_in_use", labels, pool.readahead.buffers_in_use)
        self._set("prefill_per_token_seconds", ranks, snap.prefill.per_token_s)
        self._set("prefill_per_token_kctx_seconds", ranks, snap.prefill.per_token_kctx_s)
        self._set("prefill_fixed_seconds", ranks, snap.prefill.fixed_s)
        self._set("prefill_samples", ranks, snap.prefill.samples)
        self._set("cost_policy_enabled", ranks, snap.cost_policy_enabled)
        self._set("boundary_errors", (*ranks, ErrorKind.EXPECTED.value), snap.boundary.expected)
        self._set("boundary_errors", (*ranks, ErrorKind.UNEXPECTED.value), snap.boundary.unexpected)
        self._set("streaming_enabled", ranks, snap.stream is not None)
        if snap.stream is not None:
            self._update_stream(ranks, snap.stream)

    def _update_stream(self, ranks: tuple[object, ...], stream: StreamSnapshot) -> None:
        for f in STREAM_READS:
            self._set(_stream_gauge(f), ranks, getattr(stream, f))
        if stream.bind is not None:
            for f, (gauge, _) in STREAM_BIND.items():
                self._set(gauge, ranks, getattr(stream.bind, f))
        hooks = stream.hooks
        if hooks is None:
            return  # the plugin never decided on for this backend: its figures were not measured
        for f in STREAM_HOOKS:
            self._set(_stream_gauge(f), ranks, getattr(hooks, f))
        for name, by_reason in (("stream_dropped", hooks.dropped), ("stream_not_streamed", hooks.not_streamed)):
            for reason, count in by_reason.items():
                self._set(name, (*ranks, reason), count)

    def _update_store(self, pool: tuple[object, ...], store: StoreSnapshot) -> None:
        self._set("store_pages", pool, store.pages)
        self._set("store_bytes_used", pool, store.bytes_used)
        self._set("store_capacity_bytes", pool, store.capacity_bytes)
        for c in COUNTERS:
            self._set(f"store_{c}", pool, store.counters.get(c))
        self._set("read_bandwidth_bytes_per_second", pool, store.read.bandwidth_Bps)
        self._set("read_batch_latency_seconds", pool, store.read.batch_latency_s)
        self._set("read_samples", pool, store.read.samples)
        for i, dev in enumerate(store.devices):
            device = (*pool, i, dev.path)
            self._set("device_read_bandwidth_bytes_per_second", device, dev.read.bandwidth_Bps)
            self._set("device_read_batch_latency_seconds", device, dev.read.batch_latency_s)
            self._set("device_breaker_state", device, BREAKER_VALUE[dev.breaker])
            self._set("device_breaker_trips", device, dev.trips)
        if store.namespace:
            self._update_writers((*pool, store.namespace), store)

    def _update_writers(self, shared: tuple[object, ...], store: StoreSnapshot) -> None:
        self._set("pool_bytes_used", shared, store.pool_bytes_used)
        self._set("pool_capacity_bytes", shared, store.pool_capacity_bytes)
        for state in WriterState:
            self._set("pool_writers", (*shared, state.value), sum(w.state is state for w in store.writers))
        for c in SHARING_COUNTERS:
            self._set(f"pool_{c}", shared, store.sharing.get(c))
        for w in store.writers:
            labels = (*shared, w.wid, w.host)
            self._set("writer_pages", labels, w.pages)
            self._set("writer_bytes_used", labels, w.bytes_used)
            self._set("writer_lease_age_seconds", labels, w.lease_age_s)
            self._set("writer_live", labels, None if w.state is WriterState.UNKNOWN else w.state is WriterState.LIVE)
            self._set("writer_lease_unchanged_seconds", labels, w.lease_unchanged_s)


class ProcessGauges:
    """The process's one ``Exporter``, made on first use by ``factory``; if that fails, off for good."""

    def __init__(self, factory: Callable[[], Exporter] = Exporter):
        self._factory = factory
        self._lock = threading.Lock()
        self._exporter: Exporter | None = None
        self._broken = False

    def get(self) -> Exporter | None:
        """The exporter, or None when the gauges could not be created in this process."""
        with self._lock:
            if self._exporter is None and not self._broken:
                try:
                    self._exporter = self._factory()
                except Exception as exc:  # noqa: BLE001 - e.g. names already registered by another exporter
                    self._broken = True
                    log.warning("kvtier: Prometheus gauges off in pid %d: %s: %s", os.getpid(), type(exc).__name__, exc)
            return self._exporter


PROCESS_GAUGES = ProcessGauges()


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


class PrometheusFeed:
    """One backend's feed into the process's gauges, rate-limited to one refresh per interval.

    ``metrics_on``: the backend's storage config asked for metrics. ``gauges``: where the exporter comes
    from (the process's by default). ``boundary``: counts and logs a failed refresh.
    """

    def __init__(self, metrics_on: bool, boundary: ErrorBoundary, gauges: ProcessGauges | None = None):
        self.metrics_on = metrics_on
        self._boundary = boundary
        self._gauges = PROCESS_GAUGES if gauges is None else gauges
        self._lock = threading.Lock()
        self._interval_s: float | None = None
        self._next = -math.inf

    def exporting(self) -> bool:
        """SGLang serves multiprocess metrics and this backend has metrics on."""
        return bool(os.environ.get(ENV_MULTIPROC_DIR)) and self.metrics_on

    def refresh(self, snapshot: Callable[[], TelemetrySnapshot], now: float | None = None) -> bool:
        """Refresh the gauges from ``snapshot()`` if the interval has passed; True when they were refreshed.

        Cheap between refreshes (one clock read); never raises.
        """
        t = time.monotonic() if now is None else now
        if t < self._next:
            return False
        try:
            with self._lock:
                if t < self._next:
                    return False
                if self._interval_s is None:
                    self._interval_s = _interval()
                self._next = t + self._interval_s
                if not self.exporting():
                    return False
                exporter = self._gauges.get()
                if exporter is None:
                    return False
                exporter.update(snapshot())
            return True
        except Exception as exc:  # noqa: BLE001 - a refresh must never break the scheduler step calling it
            self._boundary.fail("Prometheus refresh", exc, outcome="gauges not refreshed")
            return False
