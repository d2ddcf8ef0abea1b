"""Page keys and the namespace that scopes them.

A page key is 32 raw bytes: SGLang's chained SHA-256 token-prefix page hash (64 lowercase hex characters on
the wire); only ``parse_key`` makes a ``PageKey``. Keys carry no model, rank or layout, so the store scopes
them by a ``Namespace`` of every field that changes a page's bytes (model label, weights' fingerprint, dtype,
host layout, page geometry, rank shard) plus our schema version; each namespace shard is stored apart, so a
page of another namespace is a miss, never wrong KV. ``valid_runs`` splits a batch at invalid keys, so a
page's chain parent is always the page really preceding it. ``parts`` joins the identity only with more
than one part, so a one-part namespace digests as one recorded without the field.

Rule for changing ``Namespace``: append fields only, and bump ``SCHEMA_VERSION`` when the meaning of the
stored bytes changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NewType

import msgpack

from sgl_kvtier.errors import ConfigError

SCHEMA_VERSION = 2  # 2: model_fingerprint, dcp_rank, dcp_size
FINGERPRINT_MAX = 128
KEY_BYTES = 32
MAX_PARTS = 64  # checksummed parts per page at most (``Namespace.parts``)

PageKey = NewType("PageKey", bytes)


def parse_key(text: str) -> PageKey:
    """The 32-byte key of SGLang's 64-hex-character page hash; ``ValueError`` for anything else."""
    # Cheaper than a regex on the hot path (every batch_exists key): fromhex rejects non-hex, the length
    # check catches the whitespace fromhex would skip, and lowercase keeps one spelling per key.
    if isinstance(text, str) and len(text) == 64 and text.isascii() and text == text.lower():
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(key) == KEY_BYTES:
            return PageKey(key)
    raise ValueError(f"page key must be 64 lowercase hex characters, got {text!r:.80}")


def parse_keys(texts: Iterable[str]) -> list[PageKey]:
    """``parse_key`` of each text; ``ValueError`` at the first invalid one."""
    return [parse_key(t) for t in texts]


def valid_runs(keys: Sequence[PageKey | None]) -> list[tuple[int, list[PageKey]]]:
    """The maximal runs of consecutive valid keys (``None`` marks an invalid one), each with the index of
    its first key: ``[k0, None, k2, k3]`` -> ``[(0, [k0]), (2, [k2, k3])]``."""
    runs: list[tuple[int, list[PageKey]]] = []
    current: list[PageKey] = []
    for i, k in enumerate(keys):
        if k is None:
            current = []
            continue
        if not current:  # a fresh list (the start, or just past an invalid key) begins a run here
            runs.append((i, current))
        current.append(k)
    return runs


@dataclass(frozen=True)
class Namespace:
    """What must match for two engines to share a page."""

    model: str
    dtype: str
    layout: str  # SGLang host-pool layout, e.g. "page_first"; MLA pools are prefixed "mla:"
    page_tokens: int
    page_bytes: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    schema_version: int = SCHEMA_VERSION
    # The weights' identity (``sgl_kvtier.fingerprint``, or the operator's ``model_fingerprint`` key);
    # "" only where no engine is involved (store-level tools and tests).
    model_fingerprint: str = ""
    dcp_rank: int = 0  # decode-context-parallel shard (SGLang's ``attn_dcp_rank`` / ``attn_dcp_size``)
    dcp_size: int = 1
    # Byte length of each checksummed range of a page, in order (format 2's ``parts``); () = one part.
    parts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("namespace.model", "must be a non-empty string")
        fp = self.model_fingerprint
        if not isinstance(fp, str) or len(fp) > FINGERPRINT_MAX or not (fp.isascii() and fp.isprintable()) \
                or any(c.isspace() for c in fp):
            raise ConfigError("namespace.model_fingerprint",
                              f"must be at most {FINGERPRINT_MAX} printable ASCII characters without spaces, "
                              f"got {fp!r:.160}")
        if self.page_tokens < 1:
            raise ConfigError("namespace.page_tokens", f"must be positive, got {self.page_tokens}")
        if self.page_bytes < 1:
            raise ConfigError("namespace.page_bytes", f"must be positive, got {self.page_bytes}")
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size"), ("cp_rank", "cp_size"),
                           ("dcp_rank", "dcp_size")):
            r, s = getattr(self, rank), getattr(self, size)
            if s < 1 or not 0 <= r < s:
                raise ConfigError(f"namespace.{rank}", f"rank {r} is not in 0..{s - 1}")
        self._check_parts()

    def _check_parts(self) -> None:
        parts = tuple(self.parts)  # a list from a header's mapping too
        if not all(type(p) is int and p > 0 for p in parts) or len(parts) > MAX_PARTS \
                or (parts and sum(parts) != self.page_bytes):
            raise ConfigError("namespace.parts", f"must be at most {MAX_PARTS} positive byte lengths adding up to "
                                                 f"page_bytes ({self.page_bytes}), got {self.parts!r:.160}")
        object.__setattr__(self, "parts", () if len(parts) == 1 else parts)  # one part: the whole page

    def part_sizes(self) -> list[int]:
        """The byte length of each checksummed part of a page, in order (one part: ``[page_bytes]``)."""
        return list(self.parts) if self.parts else [self.page_bytes]

    @property
    def shard_count(self) -> int:
        """How many namespace shards of one deployment share the devices (one per rank)."""
        return self.tp_size * self.pp_size * self.cp_size * self.dcp_size

    def to_mapping(self) -> dict[str, Any]:
        """The fields as a plain dict (what device headers record); ``parts`` only when there are several."""
        values = dataclasses.asdict(self)
        if self.parts:
            values["parts"] = list(self.parts)
        else:
            del values["parts"]
        return values

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> Namespace:
        """The inverse of ``to_mapping``; unknown keys are ignored, missing appended fields default."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def digest(self) -> bytes:
        """16 bytes naming this namespace shard on disk (SHA-256 of its msgpack encoding)."""
        fields = [getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "parts" or self.parts]
        return hashlib.sha256(msgpack.packb(["sgl-kvtier-namespace", *fields])).digest()[:16]

    def dirname(self) -> str:
        """The shard's directory name, ``ns-<digest hex>``."""
        return "ns-" + self.digest().hex()

    def describe(self) -> str:
        """One human-readable line naming the shard."""
        return (f"{self.model} weights={self.model_fingerprint or '-'} {self.dtype} {self.layout} "
                f"page={self.page_tokens}t/{self.page_bytes}B tp{self.tp_rank}/{self.tp_size} "
                f"pp{self.pp_rank}/{self.pp_size} cp{self.cp_rank}/{self.cp_size} dcp{self.dcp_rank}/{self.dcp_size}"
                + (f" parts={len(self.parts)}" if self.parts else ""))
