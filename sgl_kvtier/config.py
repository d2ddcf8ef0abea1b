"""Store configuration: one frozen dataclass, validated once, at open.

``StoreConfig.from_mapping`` is the only parser: it takes the dict an operator wrote (the SGLang
extra-config JSON, a TOML file) and raises ``ConfigError`` naming the first bad field. Unknown keys are
errors too, so a typo never silently falls back to a default. Field names here are the config keys.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Mapping

from sgl_kvtier.errors import ConfigError
from sgl_kvtier.io.throttle import validate as validate_throttle

MiB = 1 << 20
GiB = 1 << 30


class Durability(str, enum.Enum):
    """When written pages are forced to stable storage."""

    BATCH = "batch"  # one data fdatasync + one journal fsync per put batch (default)
    ALWAYS = "always"  # both after every single page
    NONE = "none"  # never forced: a crash may lose recent pages (checksums still keep them from being served wrong)


class EvictionPolicyName(str, enum.Enum):
    LRU = "lru"
    CHAIN = "chain"  # deepest pages of a prefix chain go before their ancestors


class IOEngineName(str, enum.Enum):
    AUTO = "auto"  # the thread pool (measured: same GB/s as io_uring for MiB pages, steadier under GIL load)
    THREADS = "threads"
    URING = "uring"


class DirectIO(str, enum.Enum):
    AUTO = "auto"  # O_DIRECT when the filesystem accepts it, else buffered IO + fdatasync (one warning)
    ON = "on"  # O_DIRECT or fail at open
    OFF = "off"


@dataclass(frozen=True)
class StoreConfig:
    """Everything the page store needs besides the namespace (which comes from the engine)."""

    # Directories on mounted filesystems (segment files are created there) or raw block devices / regular
    # files used directly as slot arenas. Pages are striped over them in order. Required.
    devices: tuple[str, ...]
    # Byte limit of this namespace shard over all devices. None: most of the devices' free space,
    # divided by the number of shards sharing them.
    capacity_bytes: int | None = None
    # Where the journal, checkpoint and lock live. None: the first device (must then be a directory).
    meta_dir: str | None = None
    durability: Durability = Durability.BATCH
    eviction: EvictionPolicyName = EvictionPolicyName.CHAIN
    # Store a page only once it has been offered this many times (1 = store on first offer).
    admission_threshold: int = 1
    io_engine: IOEngineName = IOEngineName.AUTO
    # IOs in flight per batch.
    io_depth: int = 32
    direct_io: DirectIO = DirectIO.AUTO
    # Size of each preallocated segment file on a directory device.
    segment_bytes: int = 1 * GiB
    # Write a checkpoint (and start a new journal) after this many journal records.
    checkpoint_interval: int = 262_144
    # Circuit breaker per device: open after this many consecutive failed (or slow) IOs...
    breaker_failures: int = 3
    # ...for this long (doubling while probes fail, up to 60 s), answering misses without IO meanwhile.
    breaker_cooldown_s: float = 5.0
    # An IO slower than this counts as a failure for the breaker.
    slow_io_s: float = 2.0
    # Bytes of host memory for read-ahead: pages found by an exists query start loading into this staging
    # area at once, before SGLang's IO thread asks for them (see sgl_kvtier.prefetch.readahead). 0: off.
    readahead_bytes: int = 256 * MiB
    # Testing only: inject IO faults (see sgl_kvtier.io.faulty). None in production.
    fault_injection: dict | None = None
    # Benchmarks only: emulate a slower device (bandwidth caps and added latency, see sgl_kvtier.io.throttle).
    throttle: dict | None = None

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
        if self.throttle is not None:
            validate_throttle(self.throttle)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, ignore: frozenset[str] = frozenset()) -> "StoreConfig":
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
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value.value if isinstance(value, enum.Enum) else value
        return out


def _coerce(f: dataclasses.Field, raw: Any) -> Any:
    """Check one operator value against the field's declared type; no silent conversions."""
    name, kind = f.name, str(f.type)
    if name == "devices":
        if isinstance(raw, str):
            raw = [raw]
        if not isinstance(raw, (list, tuple)) or not all(isinstance(p, str) and p for p in raw):
            raise ConfigError(name, f"expected a list of non-empty path strings, got {raw!r}")
        return tuple(raw)
    enum_type = {"Durability": Durability, "EvictionPolicyName": EvictionPolicyName,
                 "IOEngineName": IOEngineName, "DirectIO": DirectIO}.get(kind)
    if enum_type is not None:
        try:
            return enum_type(raw)
        except ValueError:
            choices = ", ".join(m.value for m in enum_type)
            raise ConfigError(name, f"expected one of {choices}, got {raw!r}") from None
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


__all__ = ["StoreConfig", "Durability", "EvictionPolicyName", "IOEngineName", "DirectIO", "MiB", "GiB"]
