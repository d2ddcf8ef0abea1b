"""Store configuration: one frozen dataclass, validated once, at open.

``StoreConfig.from_mapping`` is the only parser: it takes the dict an operator wrote (the SGLang
extra-config JSON, a TOML file) and raises ``ConfigError`` naming the first bad field. Unknown keys are
errors too, so a typo never silently falls back to a default. Field names here are the config keys.

The two tables ``throttle`` and ``fault_injection`` are kept as the operator wrote them (so a config
round-trips through ``to_mapping``) and parsed into frozen ``ThrottleSpec`` / ``FaultSpec`` here, where
their errors name ``throttle.<key>`` / ``fault_injection.<key>``; the IO wrappers take the specs. This
module is a foundation: it imports only ``errors``, never the IO layer.

Every key documents itself where it is declared: a field's text is its ``metadata["doc"]`` (``doc``), an
enum member's meaning its ``__doc__`` (``DocumentedEnum``). The configuration reference of the
documentation site is generated from them, and a test fails on a key or member without one.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self, TypeVar

from sgl_kvtier.errors import ConfigError

MiB = 1 << 20
_HOST_ID = re.compile(r"[A-Za-z0-9._]{1,64}")
GiB = 1 << 30


DOC = "doc"  # the metadata key of a field's documentation (``doc``; the configuration reference prints it)
_T = TypeVar("_T")


def doc(default: _T, text: str) -> _T:
    """A dataclass field with ``default`` and its documentation ``text`` (``field.metadata["doc"]``)."""
    return dataclasses.field(default=default, metadata={DOC: text})


class DocumentedEnum(str, enum.Enum):
    """A str-valued enum whose members are declared ``NAME = value, meaning``: the value is the config
    string, the meaning the member's ``__doc__`` (the configuration reference prints it)."""

    _value_: str

    if TYPE_CHECKING:  # as callers see them: looked up by the string alone, valued by it
        def __new__(cls, value: str) -> Self: ...

        @property
        def value(self) -> str: ...
    else:
        def __new__(cls, value: str, meaning: str) -> Self:
            member = str.__new__(cls, value)
            member._value_ = value
            member.__doc__ = meaning
            return member


class Durability(DocumentedEnum):
    """When written pages are forced to stable storage."""

    BATCH = "batch", "One data fdatasync and one journal fsync per put batch (the default)."
    ALWAYS = "always", "Both after every single page."
    NONE = "none", ("Never forced: a crash may lose recent pages (their checksums still keep them from being "
                    "served wrong).")


class EvictionPolicyName(DocumentedEnum):
    """Which pages go first when the shard is full."""

    LRU = "lru", "The least recently used page goes first."
    CHAIN = "chain", "The deepest pages of a prefix chain go before their ancestors (the default)."


class IOEngineName(DocumentedEnum):
    """Which IO engine moves the bytes (see sgl_kvtier.io.factory)."""

    AUTO = "auto", ("The thread pool (as fast as io_uring for large pages, steadier when the GIL is busy; the "
                    "default).")
    THREADS = "threads", "A pool of IO threads making blocking positional reads and writes."
    URING = "uring", "io_uring; start-up fails naming io_engine where its probe says it cannot run on this host."


class Sharing(DocumentedEnum):
    """Whether several writer processes may share one namespace's pool."""

    HOST = "host", ("Any number of writers on one host (servers, DP replicas), each with its own segments and "
                    "journal (the default).")
    CLUSTER = "cluster", (
        "Writers on several hosts over one shared filesystem (NFSv4.1+, Lustre, GPFS, CephFS, 3FS) or a shared raw "
        "pool: as host, plus liveness of other hosts' writers by their lease counters on the observer's clock, "
        "retirement of dead ones, journal reads bounded by what each lease announced, O_DIRECT data "
        "(see sgl_kvtier.sharing.liveness).")
    OFF = "off", (
        "One writer per namespace shard, served alone: no lease, no other writer followed, no pool quota (its own "
        "capacity only). A second writer fails at start-up naming the holder, as does a live writer of the shard "
        "under host or cluster (either way round).")


class Streaming(DocumentedEnum):
    """Whether an L3 hit's not-yet-landed tail streams into the request's own prefill (an experiment)."""

    OFF = "off", "A hit is loaded (or cut by the cost model) before its request is admitted, as SGLang does (the default)."
    ON = "on", (
        "The part of a hit still in flight at admission is loaded layer group by layer group into device slots "
        "private to the request while its forward runs; a group that fails to read or verify is zeros and the "
        "request is retracted and recomputed (see sgl_kvtier.experiments.streaming). CPU engines, cache mode only.")


class DirectIO(DocumentedEnum):
    """Whether devices are opened with O_DIRECT."""

    AUTO = "auto", ("O_DIRECT where the filesystem accepts it, else buffered IO and fdatasync (one warning; the "
                    "default).")
    ON = "on", "O_DIRECT, or fail at open."
    OFF = "off", "Buffered IO and fdatasync (refused with sharing = \"cluster\")."


@dataclass(frozen=True)
class StoreConfig:
    """Everything the page store needs besides the namespace (which comes from the engine)."""

    devices: tuple[str, ...] = dataclasses.field(metadata={DOC: (
        "Directories on mounted filesystems (segment files are created there) or raw block devices / regular files "
        "used directly as slot arenas. Pages are striped over them in order. Required.")})
    capacity_bytes: int | None = doc(None, (
        "Byte limit of this namespace shard over all devices and all of its writers (one pool-wide quota that every "
        "writer keeps from the others' leases; no coordinator). At least 4096. Absent: most of the devices' free "
        "space, divided by the number of rank shards sharing them."))
    meta_dir: str | None = doc(None, (
        "Where the journal, checkpoint and writer lock live. Absent: the first device (which must then be a "
        "directory)."))
    durability: Durability = doc(Durability.BATCH, "When written pages are forced to stable storage.")
    eviction: EvictionPolicyName = doc(EvictionPolicyName.CHAIN, "Which pages go first when the shard is full.")
    admission_threshold: int = doc(1, (
        "Store a page only once it has been offered this many times, 1..1000 (1: store on first offer; 2 or more "
        "spares flash the writes of prefixes seen once)."))
    io_engine: IOEngineName = doc(IOEngineName.AUTO, "Which IO engine moves the bytes.")
    io_depth: int = doc(32, "IOs in flight per batch, 1..1024.")
    direct_io: DirectIO = doc(DirectIO.AUTO, "Whether devices are opened with O_DIRECT.")
    segment_bytes: int = doc(1 * GiB, (
        "Size of each preallocated segment file on a directory device: a multiple of 4096, at least 1 MiB."))
    checkpoint_interval: int = doc(262_144, (
        "Write a checkpoint (and start a new journal) after this many journal records."))
    breaker_failures: int = doc(3, (
        "Circuit breaker per device: open after this many consecutive failed (or slow) IOs, 1..10000."))
    breaker_cooldown_s: float = doc(5.0, (
        "How long an open breaker answers its device's pages as misses without IO before a probe, in (0, 3600] "
        "seconds (doubling while probes fail, up to 60 s)."))
    slow_io_s: float = doc(2.0, "An IO slower than this counts as a failure for the breaker, in (0, 3600] seconds.")
    sharing: Sharing = doc(Sharing.HOST, "Whether several writer processes may share one namespace's pool.")
    host_id: str | None = doc(None, (
        "This host's name in writer ids (w-<host_id>-<k>); unique per host, 1-64 of [A-Za-z0-9._]. Absent: the "
        "hostname."))
    host_index: int | None = doc(None, (
        "With sharing = \"cluster\" on a shared raw pool (sgl-kvtier pool-format): this host's slot, 0..hosts-1, "
        "distinct per host (checked against the pool's superblock at open). Absent: not a shared raw pool."))
    heartbeat_s: float = doc(2.0, (
        "A writer rewrites its lease (liveness, usage, page ages for the quota) this often, in [0.05, 600] seconds."))
    follow_interval_s: float = doc(0.2, (
        "Other writers' journals and leases are re-read at most this often (and on a lookup that falls short), in "
        "[0, 600] seconds."))
    dead_after_s: float = doc(60.0, (
        "With sharing = \"cluster\": a writer of another host whose lease has not advanced for this long, on the "
        "observer's own clock, is dead (its pages stay readable; its bytes stop counting as live). At least 3 "
        "heartbeats (with sharing = \"cluster\"), at most a day."))
    reclaim_after_s: float = doc(900.0, (
        "With sharing = \"cluster\": a writer of another host dead this long is retired by a live writer (fenced, "
        "its files deleted), or sooner when the pool quota needs its bytes. In [dead_after_s, 30 days] seconds."))
    allow_local_fs: bool = doc(False, (
        "With sharing = \"cluster\", a filesystem that only one host may mount (ext4, XFS, btrfs, tmpfs, ...) is "
        "refused at open unless this is true (one host trying cluster mode out; never for two hosts)."))
    quota_high: float = doc(0.95, (
        "Pool quota: once every writer's bytes together pass quota_high x capacity_bytes, the writers evict their "
        "oldest pages (dead writers' first) down to quota_low x capacity_bytes. In (0, 1]."))
    quota_low: float = doc(0.90, "Pool quota: where eviction stops, as a fraction of capacity_bytes, in (0, quota_high].")
    min_share_bytes: int = doc(0, (
        "Pool quota: each live writer keeps its youngest pages up to this many bytes (a newcomer may grow to it)."))
    model_fingerprint: str | None = doc(None, (
        "Identity of the model's weights in the namespace. Absent: a fingerprint of the model files, computed at "
        "start-up (config, tokenizer, weight index, sizes and sampled bytes); a string: used as is."))
    readahead_bytes: int = doc(0, (
        "Bytes of host memory for read-ahead: pages found by an exists query start loading into this staging area "
        "at once, before SGLang's IO thread asks for them (see sgl_kvtier.prefetch.readahead). 0: off."))
    streaming: Streaming = doc(Streaming.OFF, (
        "Whether an L3 hit's tail still in flight at admission streams into the request's prefill, layer group by "
        "layer group (an experiment). \"on\" needs KVTIER_STREAM=1 in the server's environment, which sgl-kvtier "
        "launch sets."))
    fault_injection: dict[str, Any] | None = doc(None, (
        "Testing only: inject IO faults (a table of FaultSpec keys, see sgl_kvtier.io.faulty). Absent in "
        "production."))
    throttle: dict[str, Any] | None = doc(None, (
        "Benchmarks only: emulate a slower device (a table of ThrottleSpec keys, see sgl_kvtier.io.throttle)."))

    def __post_init__(self) -> None:
        if not self.devices:
            raise ConfigError("devices", "at least one device path is required")
        if len(set(self.devices)) != len(self.devices):
            raise ConfigError("devices", f"a path is listed twice: {list(self.devices)}")
        if self.capacity_bytes is not None and self.capacity_bytes < 4096:
            raise ConfigError("capacity_bytes", f"must be at least 4096 bytes, got {self.capacity_bytes}")
        if not 1 <= self.admission_threshold <= 1000:
            raise ConfigError("admission_threshold", f"must be in 1..1000, got {self.admission_threshold}")
        if not 1 <= self.io_depth <= 1024:
            raise ConfigError("io_depth", f"must be in 1..1024, got {self.io_depth}")
        if self.segment_bytes < MiB or self.segment_bytes % 4096:
            raise ConfigError("segment_bytes", f"must be a multiple of 4096 and at least 1 MiB, got {self.segment_bytes}")
        if self.checkpoint_interval < 1:
            raise ConfigError("checkpoint_interval", f"must be positive, got {self.checkpoint_interval}")
        if not 1 <= self.breaker_failures <= 10_000:
            raise ConfigError("breaker_failures", f"must be in 1..10000, got {self.breaker_failures}")
        if not 0 < self.breaker_cooldown_s <= 3600:
            raise ConfigError("breaker_cooldown_s", f"must be in (0, 3600] seconds, got {self.breaker_cooldown_s}")
        if self.readahead_bytes < 0:
            raise ConfigError("readahead_bytes", f"must be 0 (off) or a byte count, got {self.readahead_bytes}")
        if not 0 < self.slow_io_s <= 3600:
            raise ConfigError("slow_io_s", f"must be in (0, 3600] seconds, got {self.slow_io_s}")
        if not 0.05 <= self.heartbeat_s <= 600:
            raise ConfigError("heartbeat_s", f"must be in [0.05, 600] seconds, got {self.heartbeat_s}")
        if not 0 <= self.follow_interval_s <= 600:
            raise ConfigError("follow_interval_s", f"must be in [0, 600] seconds, got {self.follow_interval_s}")
        if not 0 < self.quota_high <= 1:
            raise ConfigError("quota_high", f"must be in (0, 1], got {self.quota_high}")
        if not 0 < self.quota_low <= self.quota_high:
            raise ConfigError("quota_low", f"must be in (0, quota_high = {self.quota_high}], got {self.quota_low}")
        if self.min_share_bytes < 0:
            raise ConfigError("min_share_bytes", f"must be 0 or a byte count, got {self.min_share_bytes}")
        least = 3 * self.heartbeat_s if self.sharing is Sharing.CLUSTER else 0.0
        if not (0 < self.dead_after_s <= 86_400 and self.dead_after_s >= least):
            raise ConfigError("dead_after_s", f"must be at least 3 heartbeats ({3 * self.heartbeat_s:g} s) and at "
                                              f"most a day, got {self.dead_after_s}")
        if not self.dead_after_s <= self.reclaim_after_s <= 30 * 86_400:
            raise ConfigError("reclaim_after_s", f"must be in [dead_after_s = {self.dead_after_s:g}, 30 days] "
                                                 f"seconds, got {self.reclaim_after_s}")
        if self.sharing is Sharing.CLUSTER and self.direct_io is DirectIO.OFF:
            raise ConfigError("direct_io", 'must be "on" or "auto" (meaning "on") with sharing = "cluster": another '
                                           "host's writes are only seen past the page cache")
        if self.host_index is not None and (self.host_index < 0 or self.sharing is not Sharing.CLUSTER):
            raise ConfigError("host_index", 'a shared raw pool\'s host slot: 0 or more, with sharing = "cluster" '
                                            f"only (got {self.host_index} with sharing = \"{self.sharing.value}\")")
        if self.host_id is not None and not _HOST_ID.fullmatch(self.host_id):
            raise ConfigError("host_id", f"must be 1-64 of [A-Za-z0-9._] (no '-'), got {self.host_id!r}")
        self.throttle_spec()
        self.fault_spec()

    def throttle_spec(self) -> ThrottleSpec | None:
        """The parsed ``throttle`` table; None when there is none."""
        return None if self.throttle is None else ThrottleSpec.from_mapping(self.throttle)

    def fault_spec(self) -> FaultSpec | None:
        """The parsed ``fault_injection`` table; None when there is none."""
        return None if self.fault_injection is None else FaultSpec.from_mapping(self.fault_injection)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, ignore: frozenset[str] = frozenset()) -> StoreConfig:
        """Build a config from operator input; ``ignore`` names keys that belong to someone else."""
        if not isinstance(values, Mapping):
            raise ConfigError("config", f"expected a mapping of keys to values, got {type(values).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in values if k not in known and k not in ignore)
        if unknown:
            raise ConfigError(unknown[0], f"unknown key (known keys: {', '.join(sorted(known))})")
        kwargs = {name: _coerce(known[name], raw) for name, raw in values.items() if name in known}
        if "devices" not in kwargs:
            raise ConfigError("devices", "is required: a list of directory or block-device paths")
        return cls(**kwargs)

    def to_mapping(self) -> dict[str, Any]:
        """The config as operator input again: ``from_mapping(cfg.to_mapping()) == cfg``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value.value if isinstance(value, enum.Enum) else value
        return out


def _coerce(f: dataclasses.Field[Any], raw: Any) -> Any:
    """Check one operator value against the field's declared type; no silent conversions."""
    name, kind = f.name, str(f.type)
    if name == "devices":
        if isinstance(raw, str):  # one path or several in one string alike: the operator meant a list
            raise ConfigError(name, f"expected a list of paths, got the string {raw!r} (a list: [{raw!r}])")
        if not isinstance(raw, (list, tuple)) or not all(isinstance(p, str) and p for p in raw):
            raise ConfigError(name, f"expected a list of non-empty path strings, got {raw!r}")
        return tuple(raw)
    enums: dict[str, type[enum.Enum]] = {"Durability": Durability, "EvictionPolicyName": EvictionPolicyName,
                                         "IOEngineName": IOEngineName, "DirectIO": DirectIO, "Sharing": Sharing,
                                         "Streaming": Streaming}
    enum_type = enums.get(kind)
    if enum_type is not None:
        try:
            return enum_type(raw)
        except ValueError:
            choices = ", ".join(m.value for m in enum_type)
            raise ConfigError(name, f"expected one of {choices}, got {raw!r}") from None
    if kind == "bool":
        if not isinstance(raw, bool):
            raise ConfigError(name, f"expected true or false, got {raw!r}")
        return raw
    if kind.startswith("int"):
        if raw is None and "None" in kind:
            return None
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(name, f"expected an integer, got {raw!r}")
        return raw
    if kind.startswith("float"):
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(name, f"expected a number, got {raw!r}")
        return float(raw)
    if kind.startswith("dict"):
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ConfigError(name, f"expected a table of settings, got {raw!r}")
        return dict(raw)
    if kind.startswith("str"):
        if raw is None and "None" in kind:
            return None
        if not isinstance(raw, str) or not raw:
            raise ConfigError(name, f"expected a non-empty string, got {raw!r}")
        return raw
    raise ConfigError(name, f"cannot be set from {raw!r}")  # pragma: no cover - every field is handled above


THROTTLE_KEYS = ("read_bytes_per_s", "write_bytes_per_s", "latency_s")
FAULT_RATES = ("read_error_rate", "write_error_rate", "enospc_rate", "stall_rate", "torn_write_rate")
FAULT_KNOBS = (*FAULT_RATES, "stall_s", "down", "from_group")  # what a live control file may set
FAULT_KEYS = ("seed", "control_file", *FAULT_KNOBS)


@dataclass(frozen=True)
class ThrottleSpec:
    """The ``throttle`` table: the emulated slower device (sgl_kvtier.io.throttle). Absent rates: uncapped."""

    read_bytes_per_s: float = doc(math.inf, "Read rate cap of each device, bytes per second (> 0; absent: uncapped).")
    write_bytes_per_s: float = doc(math.inf, "Write rate cap of each device, bytes per second (> 0; absent: uncapped).")
    latency_s: float = doc(0.0, "Seconds added to every op, in [0, 60].")

    def __post_init__(self) -> None:
        for key in ("read_bytes_per_s", "write_bytes_per_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"throttle.{key}", f"must be a positive byte rate, got {getattr(self, key)!r}")
        if not 0 <= self.latency_s <= 60:
            raise ConfigError("throttle.latency_s", f"must be in [0, 60] seconds, got {self.latency_s!r}")

    @classmethod
    def from_mapping(cls, raw: object) -> ThrottleSpec:
        """Parse the operator's table; ``ConfigError`` naming ``throttle`` or ``throttle.<key>``."""
        table = _table("throttle", raw, THROTTLE_KEYS)
        return cls(**{key: _number(f"throttle.{key}", value) for key, value in table.items()})


@dataclass(frozen=True)
class FaultSpec:
    """The ``fault_injection`` table (testing only; what each knob does: sgl_kvtier.io.faulty)."""

    seed: int = doc(0, "Seed of the one random generator every fault decision comes from (logged at start).")
    control_file: str | None = doc(None, (
        "A JSON file with any of the knobs below, re-read when it changes (a device can vanish and come back under "
        "a running server); a half-written or invalid one leaves the previous knobs in force."))
    read_error_rate: float = doc(0.0, "Probability per read op that it fails with EIO, in [0, 1].")
    write_error_rate: float = doc(0.0, "Probability per write op that it fails with EIO, in [0, 1].")
    enospc_rate: float = doc(0.0, "Probability per write op that it fails with ENOSPC, in [0, 1].")
    stall_rate: float = doc(0.0, "Probability per op that it completes stall_s seconds late, in [0, 1].")
    torn_write_rate: float = doc(0.0, (
        "Probability per write op that only its first half reaches the device while it is reported done, in [0, 1]."))
    stall_s: float = doc(0.0, "How late a stalled op completes, in [0, 3600] seconds.")
    down: tuple[int, ...] = doc((), "Device indices (in devices order) whose every op fails with EIO: the device is gone.")
    from_group: int = doc(0, (
        "0: the knobs strike every op. Above 0: only reads of a group-major read's layer group >= this; every other "
        "op runs untouched."))

    def __post_init__(self) -> None:
        for key in FAULT_RATES:
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"fault_injection.{key}", f"must be a probability in [0, 1], got {getattr(self, key)!r}")
        if not 0 <= self.stall_s <= 3600:
            raise ConfigError("fault_injection.stall_s", f"must be in [0, 3600] seconds, got {self.stall_s!r}")

    @classmethod
    def from_mapping(cls, raw: object) -> FaultSpec:
        """Parse the operator's table; ``ConfigError`` naming ``fault_injection`` or ``fault_injection.<key>``."""
        return cls(**_fault_fields(_table("fault_injection", raw, FAULT_KEYS)))

    def with_knobs(self, raw: object) -> FaultSpec:
        """These settings with the knobs of a control file's mapping applied (``ConfigError`` if bad)."""
        return dataclasses.replace(self, **_fault_fields(_table("fault_injection.control_file", raw, FAULT_KNOBS)))


def _table(field: str, raw: object, known: tuple[str, ...]) -> Mapping[str, Any]:
    """``raw`` as a mapping with only ``known`` keys, or ``ConfigError`` naming the table or the bad key."""
    if not isinstance(raw, Mapping):
        raise ConfigError(field, f"expected a table of settings, got {raw!r}")
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise ConfigError(f"{field}.{unknown[0]}", f"unknown key (known keys: {', '.join(known)})")
    return raw


def _number(field: str, raw: object) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or math.isnan(raw):
        raise ConfigError(field, f"expected a number, got {raw!r}")
    return float(raw)


def _fault_fields(table: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, raw in table.items():
        field = f"fault_injection.{key}"
        if key == "seed":
            if isinstance(raw, bool) or not isinstance(raw, int):
                raise ConfigError(field, f"expected an integer, got {raw!r}")
            out[key] = raw
        elif key == "from_group":
            if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
                raise ConfigError(field, f"expected a read group index >= 0, got {raw!r}")
            out[key] = raw
        elif key == "control_file":
            if not isinstance(raw, str) or not raw:
                raise ConfigError(field, f"expected a path string, got {raw!r}")
            out[key] = raw
        elif key == "down":
            if not isinstance(raw, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                            for d in raw):
                raise ConfigError(field, f"expected a list of device indices, got {raw!r}")
            out[key] = tuple(raw)
        else:
            out[key] = _number(field, raw)
    return out


__all__ = ["StoreConfig", "Durability", "EvictionPolicyName", "IOEngineName", "DirectIO", "Sharing", "Streaming",
           "DocumentedEnum", "doc", "DOC", "MiB", "GiB",
           "ThrottleSpec", "FaultSpec", "THROTTLE_KEYS", "FAULT_KEYS", "FAULT_KNOBS", "FAULT_RATES"]
