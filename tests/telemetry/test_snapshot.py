"""The typed telemetry snapshot: immutable, and its JSON view of the cost inputs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sgl_kvtier.telemetry.snapshot import (
    SHARING_COUNTERS,
    Breaker,
    DeviceSnapshot,
    PoolSnapshot,
    PrefillSnapshot,
    PrefillSource,
    RankLabels,
    RateSnapshot,
    StoreSnapshot,
    StreamHookSnapshot,
    StreamSnapshot,
    TelemetrySnapshot,
    WriterSnapshot,
    WriterState,
    frozen_counts,
)


def test_a_snapshot_cannot_change():
    counts = {"get_hits": 3}
    store = StoreSnapshot(1, 4096, 8192, RateSnapshot(), counters=frozen_counts(counts))
    counts["get_hits"] = 99  # the source moves on; the snapshot does not
    assert store.counters["get_hits"] == 3
    with pytest.raises(TypeError):
        store.counters["get_hits"] = 5  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        store.pages = 2  # type: ignore[misc]


def test_cost_inputs_list_open_pools_only():
    devices = (DeviceSnapshot("/d0", RateSnapshot(1e9, 1e-3, 4), Breaker.CLOSED, 0),
               DeviceSnapshot("/d1", RateSnapshot(None, None, 0), Breaker.HALF_OPEN, 2))
    snap = TelemetrySnapshot(
        RankLabels(), pools=(PoolSnapshot("kv", 4096, StoreSnapshot(3, 3 * 4096, 8 * 4096, RateSnapshot(2e9, 2e-3, 4),
                                                                    devices)),
                             PoolSnapshot("draft", 1024)),
        prefill=PrefillSnapshot(1e-4, 0.0, 0.0, 6, PrefillSource.FIT), cost_policy_enabled=True)
    assert snap.pool("draft") == PoolSnapshot("draft", 1024) and snap.pool("mamba") is None
    assert snap.cost_inputs() == {
        "policy": "cost",
        "prefill": {"per_token_s": 1e-4, "per_token_kctx_s": 0.0, "fixed_s": 0.0, "samples": 6, "source": "fit"},
        "pools": {"kv": {"page_bytes": 4096, "read": {"bandwidth_Bps": 2e9, "batch_latency_s": 2e-3, "samples": 4},
                         "devices": [{"path": "/d0", "bandwidth_Bps": 1e9, "batch_latency_s": 1e-3, "samples": 4},
                                     {"path": "/d1", "bandwidth_Bps": None, "batch_latency_s": None, "samples": 0}]}},
    }
    json.dumps(snap.cost_inputs())  # log- and JSON-ready


def test_a_store_snapshot_carries_the_pools_writers():
    writers = (WriterSnapshot("h-0", "h", WriterState.LIVE, 2, 8192, 0.1, own=True),
               WriterSnapshot("h-1", "h", WriterState.DEAD, 1, 4096))
    store = StoreSnapshot(3, 3 * 4096, 8 * 4096, RateSnapshot(), namespace="ab" * 16, writers=writers,
                          pool_bytes_used=3 * 4096, pool_capacity_bytes=8 * 4096)
    assert [w.wid for w in store.writers if w.own] == ["h-0"] and store.writers[1].lease_age_s is None
    assert {s.value for s in WriterState} == {"live", "dead", "retired", "unknown"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        writers[0].pages = 5  # type: ignore[misc]
    assert StoreSnapshot(0, 0, 0, RateSnapshot()).writers == ()  # a snapshot without a pool: no writers
    assert StoreSnapshot(0, 0, 0, RateSnapshot()).sharing == {}  # ... and no sharing counters


def test_a_store_snapshot_carries_the_sharing_counters_and_the_watch():
    counts = {"peers_dropped": 1, "writers_retired": 1, "fenced_pages": 0, "reregistrations": 0}
    other = WriterSnapshot("b-0", "b", WriterState.RETIRED, 0, 0, lease_unchanged_s=4.5)
    store = StoreSnapshot(0, 0, 0, RateSnapshot(), writers=(other,), sharing=frozen_counts(counts))
    counts["peers_dropped"] = 7  # the pool moves on; the snapshot does not
    assert store.sharing == {**counts, "peers_dropped": 1} and tuple(store.sharing) == SHARING_COUNTERS
    with pytest.raises(TypeError):
        store.sharing["fenced_pages"] = 1  # type: ignore[index]
    assert store.writers[0].lease_unchanged_s == 4.5
    assert WriterSnapshot("a-0", "a", WriterState.LIVE, 0, 0).lease_unchanged_s is None  # this host's: by LOCK


def test_a_stream_snapshot_cannot_change():
    dropped = {"gate": 1}
    snap = StreamSnapshot(streamed_pages=3, hooks=StreamHookSnapshot(tails=2, dropped=frozen_counts(dropped)))
    dropped["gate"] = 5  # the plugin moves on; the snapshot does not
    assert snap.hooks.dropped == {"gate": 1} and snap.hooks.not_streamed == {}
    with pytest.raises(TypeError):
        snap.hooks.dropped["abort"] = 1  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.streamed_pages = 4  # type: ignore[misc]
    assert TelemetrySnapshot(RankLabels()).stream is None  # a backend that does not stream reports none
    assert StreamSnapshot().hooks is None  # the plugin not active for it: its counters unmeasured
