"""A typed, immutable picture of one backend's L3 tier at one moment: what exporters and logs read.

``KVTierStorage.telemetry()`` builds one ``TelemetrySnapshot`` per call: per pool, the store's occupancy,
counters, read rates and breakers, its shared pool's writers and sharing counters, and its read-ahead
counters; the prefill model; the policy switch; the adapter's caught exceptions; the rank labels; and, when
the backend streams, its streamed tails. Consumers (the Prometheus exporter, log lines, tests) read only
this, never the backend's attributes.

Invariants: frozen dataclasses, counters copied into read-only mappings at build time; a figure not
measured yet is ``None`` (never a made-up 0); imports no SGLang and no torch.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from sgl_kvtier.telemetry.counters import BoundaryCounts

_EMPTY: Mapping[str, int] = MappingProxyType({})
# The keys of ``sharing.pool.SharedPool.sharing_stats`` (a higher layer: named here, checked equal by the tests).
SHARING_COUNTERS = ("peers_dropped", "writers_retired", "fenced_pages", "reregistrations")


def frozen_counts(counts: Mapping[str, int]) -> Mapping[str, int]:
    """A read-only copy of ``counts`` for a snapshot."""
    return MappingProxyType(dict(counts))


@dataclass(frozen=True)
class RateSnapshot:
    """A fitted transfer model (``seconds ~= batch_latency + bytes / bandwidth``) and its sample count."""

    bandwidth_Bps: float | None = None
    batch_latency_s: float | None = None
    samples: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (the keys of ``TransferEstimator.snapshot``)."""
        return {"bandwidth_Bps": self.bandwidth_Bps, "batch_latency_s": self.batch_latency_s,
                "samples": self.samples}


class Breaker(enum.Enum):
    """A device's circuit breaker as reported (the values of the store's ``BreakerState``)."""

    CLOSED = "closed"  # healthy
    HALF_OPEN = "half_open"  # probing after its cool-down
    OPEN = "open"  # the device's pages read as misses without IO


@dataclass(frozen=True)
class DeviceSnapshot:
    """One device of a store: its own read rate and its circuit breaker."""

    path: str
    read: RateSnapshot
    breaker: Breaker
    trips: int


class WriterState(enum.Enum):
    """A writer of a shared pool as this process judges it (the pool's lease watch, ``sharing.liveness``)."""

    LIVE = "live"  # this host: its LOCK is held; another host: its lease counter advances (``dead_after_s``)
    DEAD = "dead"  # its LOCK is free, its host rebooted, or its lease stood still for ``dead_after_s``; its
    # pages stay readable until it is retired
    RETIRED = "retired"  # fenced by a live writer of another host (``sharing = "cluster"``), or gone from the
    # pool since (its directory removed or retired): its pages are no longer read
    UNKNOWN = "unknown"  # no readable lease and no LOCK (being created, or damaged)


@dataclass(frozen=True)
class WriterSnapshot:
    """One writer of the pool: the own one's usage now, another's from its last lease."""

    wid: str
    host: str
    state: WriterState
    pages: int
    bytes_used: int
    lease_age_s: float | None = None  # since its last beat (another writer's: its LEASE file's mtime); None: none yet
    own: bool = False  # this process's writer
    # Another host's writer: how long this process's watch has seen its lease counter unchanged (on our own
    # clock; dead at ``dead_after_s``). None: a writer of this host (judged by its LOCK), or not judged now.
    lease_unchanged_s: float | None = None


@dataclass(frozen=True)
class StoreSnapshot:
    """One open page-store shard: occupancy, running counters, and read rates (all devices and each); the
    shared pool's writers and what its pool-wide cap counts (own usage + the others' leased bytes)."""

    pages: int
    bytes_used: int
    capacity_bytes: int
    read: RateSnapshot
    devices: tuple[DeviceSnapshot, ...] = ()
    counters: Mapping[str, int] = field(default_factory=lambda: _EMPTY)  # StoreCounters field -> running total
    namespace: str = ""  # the namespace digest (hex): the ``ns-<digest>`` directory of the pool
    writers: tuple[WriterSnapshot, ...] = ()
    pool_bytes_used: int | None = None  # own bytes + every other writer's leased bytes_used (dead ones too)
    pool_capacity_bytes: int | None = None  # the pool-wide cap (``capacity_bytes``)
    # ``SharedPool.sharing_stats``: running totals since the pool opened (``SHARING_COUNTERS``)
    sharing: Mapping[str, int] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True)
class ReadAheadSnapshot:
    """One pool's read-ahead stage: its running counters (pages) and the staging buffers held now."""

    buffers_in_use: int
    counters: Mapping[str, int] = field(default_factory=lambda: _EMPTY)  # ReadAheadCounters field -> running total


@dataclass(frozen=True)
class PoolSnapshot:
    """One registered host pool and its shard; ``store`` is None while a reader's shard is not open."""

    name: str
    page_bytes: int
    store: StoreSnapshot | None = None
    readahead: ReadAheadSnapshot | None = None


class PrefillSource(enum.Enum):
    """Where the prefill model in use comes from."""

    FIT = "fit"  # least squares over measured batches
    SEED = "seed"  # KVTIER_PREFILL_TOKENS_PER_S, until enough batches were measured


@dataclass(frozen=True)
class PrefillSnapshot:
    """The prefill model in use (None: none yet) and how many batches were measured."""

    per_token_s: float | None = None
    per_token_kctx_s: float | None = None
    fixed_s: float | None = None
    samples: int = 0
    source: PrefillSource | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (the keys of ``PrefillEstimator.snapshot``)."""
        return {"per_token_s": self.per_token_s, "per_token_kctx_s": self.per_token_kctx_s,
                "fixed_s": self.fixed_s, "samples": self.samples,
                "source": None if self.source is None else self.source.value}


@dataclass(frozen=True)
class StreamHookSnapshot:
    """The stream plugin's counters in this process (``experiments.streaming.hooks.core.hook_snapshot``):
    running totals since the process started (one scheduler, one backend per process)."""

    # admission (scheduler thread)
    bind_calls: int = 0  # hits handed to the backend to bind (it may decline)
    tails: int = 0  # tails registered: the part of a hit not landed at its ack, streaming on
    ready: int = 0  # tails the T_hide gate let through
    admitted: int = 0  # tails loaded back into private device slots with their request
    gate_waits: int = 0  # admission polls the gate answered "not yet"
    gate_wait_s: float = 0.0  # registration to READY, summed over the tails let through
    withheld_registered_slots: int = 0  # slots of registered tails SGLang tried to release (kept back; a bug)
    not_streamed: Mapping[str, int] = field(default_factory=lambda: _EMPTY)  # why a hit's tail was not registered
    dropped: Mapping[str, int] = field(default_factory=lambda: _EMPTY)  # tails given up before their forward, by why
    # the forward (the tail loader)
    loads: int = 0  # batches with streamed tails
    loaded_tails: int = 0
    copied_layers: int = 0  # (tail, layer) copies of verified bytes
    zeroed_layers: int = 0  # (tail, layer) zero-fills
    zero_filled_groups: int = 0  # layer groups the loader put zeros in (failed, late, a failed copy, injected)
    timeouts: int = 0  # of those, deadlines passed
    landed: int = 0  # tails whose rank-agreed verdict was landed: kept
    poisoned: int = 0  # tails whose verdict was a failure: their request retracted (or aborted)
    stalls: int = 0  # forward reads that waited for a tail layer still loading
    stall_s: float = 0.0  # time those reads waited
    # the retract path
    retracts: int = 0  # requests retracted after a forward (output dropped, KV released, recomputed)
    requeued: int = 0
    aborted: int = 0  # requests that could not be retracted and were aborted instead (503)


@dataclass(frozen=True)
class StreamBindSnapshot:
    """The bind rule's learned figures of one backend (``experiments.streaming.rules.bind.StreamCosts``; None: not
    learned yet): the whole-load wait W = fixed + bytes x per-MB (fitted on hits loaded whole alone), the
    interference k (seconds a forward ran over the prefill model per MB of streamed tail) and the load-back copy
    X a whole load makes before its forward, each with its sample count (used from the second sample on); and
    each path's measured excess over compute per MB, from hits timed end to end (they decide once both exist)."""

    whole_wait_fixed_s: float | None = None
    whole_wait_s_per_mb: float | None = None
    whole_samples: int = 0
    interference_s_per_mb: float | None = None
    interference_samples: int = 0
    load_back_fixed_s: float | None = None  # X: SGLang's own host -> device load-backs, fixed + per MB
    load_back_s_per_mb: float | None = None
    load_back_samples: int = 0
    measured_whole_s_per_mb: float | None = None  # a hit loaded whole: its request's time over compute, per MB
    measured_whole_hits: int = 0
    measured_stream_s_per_mb: float | None = None  # a streamed hit: the same, measured alike
    measured_stream_hits: int = 0


@dataclass(frozen=True)
class StreamSnapshot:
    """Streamed L3 tails of one backend: its binder's reads (``experiments.streaming.binding.StreamCounters``,
    running totals), the stream plugin's counters once it is active for this backend (``hooks``), and the bind
    rule's learned figures (``bind``)."""

    bound_hits: int = 0  # hits bound to a tail stream
    read_groups: int = 0  # their read groups, summed (``experiments.streaming.rules.read_groups``)
    head_pages: int = 0  # pages answered True to SGLang's IO thread from a stream (inserted as usual)
    streamed_pages: int = 0  # pages streams landed whole and verified
    staged_pages: int = 0  # ... of which copied from read-ahead staging
    failed_pages: int = 0  # pages of streams that did not land (cancelled streams not counted)
    failed_groups: int = 0  # (stream, layer group) reads that did not land on every page of the stream
    cancelled: int = 0  # streams cancelled (released slots, a dropped tail, close)
    read_errors: int = 0  # streams whose read raised
    withheld_pages: int = 0  # released pages kept back until their stream ended (then freed)
    mismatches: int = 0  # answers or binds that found a stream where none was expected (bugs)
    hooks: StreamHookSnapshot | None = None
    bind: StreamBindSnapshot | None = None  # None: no bind rule (a backend that does not stream)


@dataclass(frozen=True)
class RankLabels:
    """The parallel ranks of the SGLang process a backend lives in: labels that keep ranks' series apart."""

    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0


@dataclass(frozen=True)
class TelemetrySnapshot:
    """Everything one backend reports, at one moment."""

    ranks: RankLabels
    pools: tuple[PoolSnapshot, ...] = ()
    prefill: PrefillSnapshot = PrefillSnapshot()
    cost_policy_enabled: bool = False
    boundary: BoundaryCounts = BoundaryCounts()
    stream: StreamSnapshot | None = None  # None: this backend does not stream (``streaming = "off"``, a layout)

    def pool(self, name: str) -> PoolSnapshot | None:
        """The pool called ``name``, if registered."""
        return next((p for p in self.pools if p.name == name), None)

    def cost_inputs(self) -> dict[str, Any]:
        """The cost policy's measured inputs, JSON-ready: the switch, the prefill model, and per open pool
        the page size and read rates (all devices together, and each device with its path)."""
        pools = {p.name: {"page_bytes": p.page_bytes, "read": p.store.read.as_dict(),
                          "devices": [{"path": d.path, **d.read.as_dict()} for d in p.store.devices]}
                 for p in self.pools if p.store is not None}
        return {"policy": "cost" if self.cost_policy_enabled else "off", "prefill": self.prefill.as_dict(),
                "pools": pools}


__all__ = ["Breaker", "RateSnapshot", "DeviceSnapshot", "WriterState", "WriterSnapshot", "StoreSnapshot", "ReadAheadSnapshot", "PoolSnapshot", "PrefillSource",
           "PrefillSnapshot", "StreamHookSnapshot", "StreamSnapshot", "RankLabels", "TelemetrySnapshot", "SHARING_COUNTERS",
           "frozen_counts"]
