"""``telemetry.prometheus``: every ``kvtier_`` gauge from a typed snapshot, and the feed that rate-limits it.

The exporter writes into a private registry; the feed is given its own ``ProcessGauges`` so that nothing
touches prometheus_client's process-wide default registry. No SGLang, no torch.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
from prometheus_client import CollectorRegistry

from sgl_kvtier.prefetch import ReadAheadCounters
from sgl_kvtier.store.health import BreakerState
from sgl_kvtier.telemetry import prometheus
from sgl_kvtier.telemetry.counters import BoundaryCounts, ErrorBoundary, StoreCounters
from sgl_kvtier.telemetry.snapshot import (
    SHARING_COUNTERS,
    Breaker,
    DeviceSnapshot,
    PoolSnapshot,
    PrefillSnapshot,
    PrefillSource,
    RankLabels,
    RateSnapshot,
    ReadAheadSnapshot,
    StoreSnapshot,
    StreamBindSnapshot,
    StreamHookSnapshot,
    StreamSnapshot,
    TelemetrySnapshot,
    WriterSnapshot,
    WriterState,
    frozen_counts,
)

PAGE = 16384
RANKS = {"tp_rank": "2", "pp_rank": "0", "dp_rank": "1"}
KV = {"pool": "kv", **RANKS}
# Every gauge name dashboards may rely on, plus the boundary's.
NAMES = {
    "read_bandwidth_bytes_per_second", "read_batch_latency_seconds", "read_samples",
    "device_read_bandwidth_bytes_per_second", "device_read_batch_latency_seconds", "device_breaker_state",
    "device_breaker_trips", "store_pages", "store_bytes_used", "store_capacity_bytes",
    *(f"store_{c}" for c in ("put_pages", "put_present", "put_declined", "put_no_space", "get_hits", "get_misses",
                             "corrupt_pages", "remote_reuse_races", "io_errors", "evictions", "bad_requests",
                             "bytes_written", "bytes_read", "parts_read", "parts_failed", "segments_reopened",
                             "fresh_rereads")),
    *(f"readahead_{c}" for c in ("staged", "served", "joined", "failed", "dropped", "skipped_full")),
    "readahead_buffers_in_use", "prefill_per_token_seconds", "prefill_per_token_kctx_seconds",
    "prefill_fixed_seconds", "prefill_samples", "cost_policy_enabled", "boundary_errors",
    # the shared pool
    "pool_bytes_used", "pool_capacity_bytes", "pool_writers", "writer_pages", "writer_bytes_used",
    "writer_lease_age_seconds", "writer_live",
    # sharing = "cluster"
    "pool_peers_dropped", "pool_writers_retired", "pool_fenced_pages", "pool_reregistrations",
    "writer_lease_unchanged_seconds",
    # streamed L3 tails
    "streaming_enabled", "stream_dropped", "stream_not_streamed",
    "stream_bind_whole_wait_fixed_seconds", "stream_bind_whole_wait_seconds_per_megabyte", "stream_bind_whole_samples",
    "stream_bind_interference_seconds_per_megabyte", "stream_bind_interference_samples",
    "stream_bind_load_back_fixed_seconds", "stream_bind_load_back_seconds_per_megabyte", "stream_bind_load_back_samples",
    "stream_bind_measured_whole_seconds_per_megabyte", "stream_bind_measured_whole_hits",
    "stream_bind_measured_stream_seconds_per_megabyte", "stream_bind_measured_stream_hits",
    *(f"stream_{c}" for c in ("bound_hits", "read_groups", "head_pages", "streamed_pages", "staged_pages", "failed_pages",
                              "failed_groups", "cancelled", "read_errors", "withheld_pages", "mismatches",
                              "bind_calls", "tails", "ready", "admitted", "gate_waits", "gate_wait_seconds",
                              "withheld_registered_slots", "loads", "loaded_tails", "copied_layers", "zeroed_layers",
                              "zero_filled_groups", "timeouts", "landed", "poisoned", "stalls", "stall_seconds",
                              "retracts", "requeued", "aborted")),
}


def snapshot(pages: int = 8, policy: bool = True) -> TelemetrySnapshot:
    store = StoreSnapshot(
        pages=pages, bytes_used=pages * PAGE, capacity_bytes=32 * PAGE, read=RateSnapshot(2e9, 1e-3, 3),
        devices=(DeviceSnapshot("/d0", RateSnapshot(1e9, 2e-3, 3), Breaker.CLOSED, 0),
                 DeviceSnapshot("/d1", RateSnapshot(), Breaker.OPEN, 1)),
        counters=frozen_counts(StoreCounters(put_pages=pages, get_hits=pages, bytes_read=pages * PAGE).snapshot()))
    staged = ReadAheadSnapshot(2, frozen_counts(ReadAheadCounters(staged=pages, served=pages - 2).snapshot()))
    return TelemetrySnapshot(
        ranks=RankLabels(2, 0, 1), pools=(PoolSnapshot("kv", PAGE, store, staged), PoolSnapshot("draft", 4096)),
        prefill=PrefillSnapshot(1e-4, 0.0, 0.01, samples=5, source=PrefillSource.FIT), cost_policy_enabled=policy,
        boundary=BoundaryCounts(expected=3, unexpected=1))


def test_the_exporter_knows_every_counter_of_the_store_and_read_ahead():
    assert prometheus.READAHEAD == tuple(f.name for f in dataclasses.fields(ReadAheadCounters))
    assert prometheus.COUNTERS == tuple(f.name for f in dataclasses.fields(StoreCounters))
    assert {b.value for b in Breaker} == {s.value for s in BreakerState} == {b.value for b in prometheus.BREAKER_VALUE}


def test_every_gauge_keeps_its_name_and_labels():
    assert {name for name, _, _ in prometheus._GAUGES} == NAMES
    labels = {name: lab for name, _, lab in prometheus._GAUGES}
    assert labels["store_pages"] == ("pool", "tp_rank", "pp_rank", "dp_rank")
    assert labels["device_breaker_state"] == ("pool", "tp_rank", "pp_rank", "dp_rank", "device", "path")
    assert labels["prefill_samples"] == ("tp_rank", "pp_rank", "dp_rank")
    assert labels["boundary_errors"] == ("tp_rank", "pp_rank", "dp_rank", "kind")
    assert labels["writer_live"] == ("pool", "tp_rank", "pp_rank", "dp_rank", "namespace", "wid", "host")
    assert labels["pool_writers"] == ("pool", "tp_rank", "pp_rank", "dp_rank", "namespace", "state")
    assert labels["stream_tails"] == labels["stream_stall_seconds"] == ("tp_rank", "pp_rank", "dp_rank")
    assert labels["stream_dropped"] == ("tp_rank", "pp_rank", "dp_rank", "reason")


def test_gauges_show_the_snapshot():
    registry = CollectorRegistry()
    prometheus.Exporter(registry).update(snapshot())
    value = registry.get_sample_value
    assert value("kvtier_store_pages", KV) == 8
    assert value("kvtier_store_bytes_used", KV) == 8 * PAGE
    assert value("kvtier_store_capacity_bytes", KV) == 32 * PAGE
    assert value("kvtier_store_put_pages", KV) == value("kvtier_store_get_hits", KV) == 8
    assert value("kvtier_store_bytes_read", KV) == 8 * PAGE and value("kvtier_store_io_errors", KV) == 0
    assert value("kvtier_read_bandwidth_bytes_per_second", KV) == 2e9
    assert value("kvtier_read_batch_latency_seconds", KV) == 1e-3 and value("kvtier_read_samples", KV) == 3
    d0, d1 = {**KV, "device": "0", "path": "/d0"}, {**KV, "device": "1", "path": "/d1"}
    assert value("kvtier_device_read_bandwidth_bytes_per_second", d0) == 1e9
    assert value("kvtier_device_read_bandwidth_bytes_per_second", d1) is None  # not measured: no series
    assert value("kvtier_device_breaker_state", d0) == 0 and value("kvtier_device_breaker_state", d1) == 1
    assert value("kvtier_device_breaker_trips", d1) == 1
    assert value("kvtier_readahead_staged", KV) == 8 and value("kvtier_readahead_served", KV) == 6
    assert value("kvtier_readahead_buffers_in_use", KV) == 2
    assert value("kvtier_store_pages", {**KV, "pool": "draft"}) is None  # a reader's shard not open yet
    assert value("kvtier_prefill_per_token_seconds", RANKS) == 1e-4
    assert value("kvtier_prefill_fixed_seconds", RANKS) == 0.01 and value("kvtier_prefill_samples", RANKS) == 5
    assert value("kvtier_cost_policy_enabled", RANKS) == 1
    assert value("kvtier_boundary_errors", {**RANKS, "kind": "expected"}) == 3
    assert value("kvtier_boundary_errors", {**RANKS, "kind": "unexpected"}) == 1


def test_gauges_show_every_writer_of_the_shared_pool():
    writers = (WriterSnapshot("a-0", "a", WriterState.LIVE, 8, 8 * PAGE, 0.5, own=True),
               WriterSnapshot("a-1", "a", WriterState.DEAD, 3, 3 * PAGE, 40.0),
               WriterSnapshot("b-0", "b", WriterState.UNKNOWN, 5, 5 * PAGE, None))
    base = snapshot()
    store = dataclasses.replace(base.pools[0].store, namespace="ab" * 16, writers=writers,
                                pool_bytes_used=16 * PAGE, pool_capacity_bytes=32 * PAGE)
    registry = CollectorRegistry()
    prometheus.Exporter(registry).update(dataclasses.replace(base, pools=(PoolSnapshot("kv", PAGE, store),)))
    value = registry.get_sample_value
    shared = {**KV, "namespace": "ab" * 16}
    assert value("kvtier_pool_bytes_used", shared) == 16 * PAGE
    assert value("kvtier_pool_capacity_bytes", shared) == 32 * PAGE
    assert [value("kvtier_pool_writers", {**shared, "state": s}) for s in ("live", "dead", "unknown")] == [1, 1, 1]
    assert value("kvtier_pool_writers", {**shared, "state": "retired"}) == 0
    a0, a1, b0 = ({**shared, "wid": w, "host": h} for w, h in (("a-0", "a"), ("a-1", "a"), ("b-0", "b")))
    assert [value("kvtier_writer_pages", w) for w in (a0, a1, b0)] == [8, 3, 5]
    assert [value("kvtier_writer_bytes_used", w) for w in (a0, a1, b0)] == [8 * PAGE, 3 * PAGE, 5 * PAGE]
    assert [value("kvtier_writer_lease_age_seconds", w) for w in (a0, a1, b0)] == [0.5, 40.0, None]
    assert [value("kvtier_writer_live", w) for w in (a0, a1, b0)] == [1, 0, None]  # another host's: unknown
    # A snapshot without a shared pool (no namespace) exports none of these.
    empty = CollectorRegistry()
    prometheus.Exporter(empty).update(snapshot())
    assert empty.get_sample_value("kvtier_pool_writers", {**KV, "namespace": "", "state": "live"}) is None


def test_gauges_show_the_sharing_counters_and_other_hosts_writers():
    writers = (WriterSnapshot("a-0", "a", WriterState.LIVE, 8, 8 * PAGE, 0.2, own=True),
               WriterSnapshot("b-0", "b", WriterState.LIVE, 5, 5 * PAGE, 0.3, lease_unchanged_s=0.1),
               WriterSnapshot("c-0", "c", WriterState.DEAD, 2, 2 * PAGE, 90.0, lease_unchanged_s=61.5),
               WriterSnapshot("d-0", "d", WriterState.RETIRED, 0, 0))
    sharing = {"peers_dropped": 1, "writers_retired": 1, "fenced_pages": 3, "reregistrations": 1}
    base = snapshot()
    store = dataclasses.replace(base.pools[0].store, namespace="cd" * 16, writers=writers,
                                pool_bytes_used=15 * PAGE, pool_capacity_bytes=32 * PAGE, sharing=frozen_counts(sharing))
    registry = CollectorRegistry()
    prometheus.Exporter(registry).update(dataclasses.replace(base, pools=(PoolSnapshot("kv", PAGE, store),)))
    value = registry.get_sample_value
    shared = {**KV, "namespace": "cd" * 16}
    assert {c: value(f"kvtier_pool_{c}", shared) for c in SHARING_COUNTERS} == sharing
    states = ("live", "dead", "retired", "unknown")
    assert [value("kvtier_pool_writers", {**shared, "state": s}) for s in states] == [2, 1, 1, 0]
    a0, b0, c0, d0 = ({**shared, "wid": f"{h}-0", "host": h} for h in "abcd")
    assert [value("kvtier_writer_live", w) for w in (a0, b0, c0, d0)] == [1, 1, 0, 0]  # retired: not live
    assert [value("kvtier_writer_lease_unchanged_seconds", w) for w in (a0, b0, c0, d0)] == [None, 0.1, 61.5, None]
    assert value("kvtier_writer_pages", d0) == 0 and value("kvtier_writer_lease_age_seconds", d0) is None
    # Without sharing counters in the snapshot (no shared pool): no series.
    empty = CollectorRegistry()
    prometheus.Exporter(empty).update(snapshot())
    assert empty.get_sample_value("kvtier_pool_peers_dropped", {**KV, "namespace": ""}) is None


def test_an_unmeasured_prefill_model_has_no_series():
    registry = CollectorRegistry()
    snap = snapshot(policy=False)
    prometheus.Exporter(registry).update(TelemetrySnapshot(snap.ranks, snap.pools, PrefillSnapshot(), False))
    assert registry.get_sample_value("kvtier_prefill_per_token_seconds", RANKS) is None
    assert registry.get_sample_value("kvtier_prefill_samples", RANKS) == 0
    assert registry.get_sample_value("kvtier_cost_policy_enabled", RANKS) == 0


def test_streamed_tails_have_series_only_when_the_backend_streams():
    snap = snapshot()
    hooks = StreamHookSnapshot(
        bind_calls=4, tails=3, ready=2, admitted=2, gate_waits=7, gate_wait_s=0.25,
        not_streamed=frozen_counts({"withheld cap": 1}), dropped=frozen_counts({"gate": 1, "abort": 2}), loads=2,
        loaded_tails=2, copied_layers=11, zeroed_layers=1, zero_filled_groups=1, landed=1, poisoned=1, stalls=5,
        stall_s=0.125, retracts=1, requeued=1)
    streamed = StreamSnapshot(bound_hits=4, head_pages=6, streamed_pages=20, failed_pages=1, failed_groups=1,
                              withheld_pages=3, hooks=hooks)
    registry = CollectorRegistry()
    exporter = prometheus.Exporter(registry)
    value = registry.get_sample_value
    exporter.update(snap)  # streaming off: the switch says so, and no stream figure has a series
    assert value("kvtier_streaming_enabled", RANKS) == 0 and value("kvtier_stream_bound_hits", RANKS) is None
    exporter.update(dataclasses.replace(snap, stream=dataclasses.replace(streamed, hooks=None)))
    assert value("kvtier_streaming_enabled", RANKS) == 1 and value("kvtier_stream_streamed_pages", RANKS) == 20
    assert value("kvtier_stream_tails", RANKS) is None  # the plugin never ran for it: its figures unmeasured
    exporter.update(dataclasses.replace(snap, stream=streamed))
    reads = {f: value(f"kvtier_stream_{f}", RANKS) for f in prometheus.STREAM_READS}
    assert reads == {f: getattr(streamed, f) for f in prometheus.STREAM_READS}
    assert value("kvtier_stream_tails", RANKS) == 3 and value("kvtier_stream_gate_waits", RANKS) == 7
    assert value("kvtier_stream_gate_wait_seconds", RANKS) == 0.25 and value("kvtier_stream_stall_seconds", RANKS) == 0.125
    assert value("kvtier_stream_zero_filled_groups", RANKS) == 1 and value("kvtier_stream_retracts", RANKS) == 1
    assert value("kvtier_stream_aborted", RANKS) == 0  # measured (the plugin ran): a real 0
    assert value("kvtier_stream_dropped", {**RANKS, "reason": "abort"}) == 2
    assert value("kvtier_stream_dropped", {**RANKS, "reason": "gate"}) == 1
    assert value("kvtier_stream_not_streamed", {**RANKS, "reason": "withheld cap"}) == 1
    assert set(prometheus.STREAM_HOOKS) | {"dropped", "not_streamed"} == {
        f.name for f in dataclasses.fields(StreamHookSnapshot)}
    assert value("kvtier_stream_bind_whole_samples", RANKS) is None  # no bind rule in this snapshot
    # The bind rule's learned figures: one gauge each, none for a figure not learned yet.
    bind = StreamBindSnapshot(whole_wait_fixed_s=0.04, whole_wait_s_per_mb=1.6e-3, whole_samples=3,
                              interference_samples=1)
    exporter.update(dataclasses.replace(snap, stream=dataclasses.replace(streamed, bind=bind)))
    assert value("kvtier_stream_bind_whole_wait_fixed_seconds", RANKS) == 0.04
    assert value("kvtier_stream_bind_whole_wait_seconds_per_megabyte", RANKS) == 1.6e-3
    assert value("kvtier_stream_bind_whole_samples", RANKS) == 3
    assert value("kvtier_stream_bind_interference_samples", RANKS) == 1
    assert value("kvtier_stream_bind_interference_seconds_per_megabyte", RANKS) is None
    assert set(prometheus.STREAM_BIND) == {f.name for f in dataclasses.fields(StreamBindSnapshot)}


class Snapshots:
    """A snapshot source that counts how often it was asked."""

    def __init__(self, snap=None, error: BaseException | None = None):
        self.snap, self.error, self.calls = snap or snapshot(), error, 0

    def __call__(self) -> TelemetrySnapshot:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.snap


def feed(metrics_on=True, factory=None, registry=None):
    registry = registry if registry is not None else CollectorRegistry()
    gauges = prometheus.ProcessGauges(factory or (lambda: prometheus.Exporter(registry)))
    boundary = ErrorBoundary(logging.getLogger("test.kvtier"), (OSError,))
    return prometheus.PrometheusFeed(metrics_on, boundary, gauges), boundary, registry


@pytest.fixture
def multiproc(monkeypatch, tmp_path):
    monkeypatch.setenv(prometheus.ENV_MULTIPROC_DIR, str(tmp_path))
    monkeypatch.delenv(prometheus.ENV_INTERVAL, raising=False)
    return tmp_path


def test_inert_without_multiprocess_dir_or_with_metrics_off(monkeypatch, tmp_path):
    made = []
    monkeypatch.delenv(prometheus.ENV_MULTIPROC_DIR, raising=False)
    f, _, _ = feed(factory=lambda: made.append(1))
    source = Snapshots()
    assert f.refresh(source, now=10.0) is False
    monkeypatch.setenv(prometheus.ENV_MULTIPROC_DIR, str(tmp_path))
    off, _, _ = feed(metrics_on=False, factory=lambda: made.append(1))
    assert off.refresh(source, now=20.0) is False
    assert made == [] and source.calls == 0 and list(tmp_path.glob("*.db")) == []  # nothing created or written


def test_refreshes_at_most_once_per_interval(multiproc):
    f, _, registry = feed()
    assert f.refresh(Snapshots(snapshot(pages=2)), now=100.0) is True
    later = Snapshots(snapshot(pages=4))
    assert f.refresh(later, now=100.5) is False  # within the default 1 s: not even a snapshot is built
    assert later.calls == 0 and registry.get_sample_value("kvtier_store_pages", KV) == 2
    assert f.refresh(later, now=101.0) is True
    assert registry.get_sample_value("kvtier_store_pages", KV) == 4


def test_a_failed_refresh_is_counted_and_logged_never_raised(multiproc, caplog):
    f, boundary, _ = feed()
    with caplog.at_level(logging.ERROR, logger="test.kvtier"):
        assert f.refresh(Snapshots(error=OSError("disk gone")), now=1.0) is False
    assert boundary.counts() == BoundaryCounts(expected=1, unexpected=0)
    assert "disk gone" in caplog.text and "gauges not refreshed" in caplog.text
    assert f.refresh(Snapshots(), now=2.0) is True  # the next interval tries again


def test_gauges_stay_off_when_they_cannot_be_created(multiproc):
    calls = []

    def refuse():
        calls.append(1)
        raise ValueError("Duplicated timeseries in CollectorRegistry")

    f, boundary, _ = feed(factory=refuse)
    assert f.refresh(Snapshots(), now=1.0) is False
    assert f.refresh(Snapshots(), now=5.0) is False
    assert len(calls) == 1 and boundary.counts() == BoundaryCounts()  # not retried on every scheduler step


def test_interval_from_the_environment(monkeypatch):
    monkeypatch.setenv(prometheus.ENV_INTERVAL, "0")
    assert prometheus._interval() == 0.0
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv(prometheus.ENV_INTERVAL, bad)
        assert prometheus._interval() == prometheus.DEFAULT_INTERVAL_S
