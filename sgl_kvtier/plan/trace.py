"""Request traces for the planner: what arrived when, and which prompt blocks it shares with others.

Two formats are read (``load``):

- ``mooncake``: the Mooncake FAST'25 trace format, one JSON object per line: ``timestamp`` (ms since the
  start), ``input_length`` and ``output_length`` (tokens) and ``hash_ids``, one id per ``block_tokens``
  (512) prompt tokens, equal ids meaning equal prefixes (the last block may be partial).
- ``sglang``: SGLang's own request log, written by a server started with ``--log-requests
  --log-requests-level 3 --log-requests-format json --log-requests-target DIR``: one ``request.finished``
  event per request with its ``input_ids``; the arrival is the event's time less ``e2e_latency``. Blocks are
  ``block_tokens`` (the page size) of token ids, named by their content and their parent, so equal ids mean
  equal prefixes as in SGLang's chained page hashes.

Invariants: requests are in arrival order, arrivals start at 0; block ``i`` of a request chains on block
``i - 1``; a block's id names its whole prefix. Bad input raises ``TraceError`` naming the file, the line
and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any

from sgl_kvtier.errors import KVTierError

MOONCAKE_BLOCK_TOKENS = 512


class TraceError(KVTierError, ValueError):
    """A trace file cannot be read; the message names the file, the line and the field."""


class TraceFormat(Enum):
    MOONCAKE = "mooncake"
    SGLANG = "sglang"


@dataclass(frozen=True)
class TraceRequest:
    """One request: arrival (s from the trace's start), prompt and output tokens, and its prompt's block ids."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order; each block is ``block_tokens`` prompt tokens (the last one may be fewer)."""

    requests: tuple[TraceRequest, ...]
    block_tokens: int
    source: str

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def block_sizes(self, request: TraceRequest) -> list[int]:
        """Prompt tokens in each of ``request``'s blocks."""
        full = request.input_tokens // self.block_tokens
        sizes = [self.block_tokens] * min(full, len(request.blocks))
        if len(sizes) < len(request.blocks):
            sizes.append(max(0, request.input_tokens - full * self.block_tokens))
        return sizes

    def head(self, seconds: float | None = None, requests: int | None = None) -> Trace:
        """The first ``seconds`` of the trace and at most ``requests`` requests."""
        kept = [r for r in self.requests if seconds is None or r.arrival_s <= seconds]
        return Trace(tuple(kept[:requests] if requests is not None else kept), self.block_tokens, self.source)

    def repeated(self, times: int) -> Trace:
        """``times`` copies one after another (a longer trace with the same mix; each copy's blocks are its
        own, so no copy reuses another's, and the span grows ``times``-fold)."""
        if times < 1:
            raise ValueError(f"times must be >= 1, got {times}")
        span = self.duration_s + 1.0
        top = 1 + max((b for r in self.requests for b in r.blocks), default=0)
        out = [TraceRequest(r.arrival_s + k * span, r.input_tokens, r.output_tokens,
                            tuple(b + k * top for b in r.blocks))
               for k in range(times) for r in self.requests]
        return Trace(tuple(out), self.block_tokens, f"{self.source} x{times}")

    def summary(self) -> dict[str, Any]:
        """Requests, span, tokens, block references and unique blocks (an unbounded cache's best hit rate)."""
        refs = sum(len(r.blocks) for r in self.requests)
        unique = len({b for r in self.requests for b in r.blocks})
        return {"source": self.source, "requests": len(self.requests), "duration_s": self.duration_s,
                "block_tokens": self.block_tokens, "input_tokens": sum(r.input_tokens for r in self.requests),
                "output_tokens": sum(r.output_tokens for r in self.requests), "block_refs": refs,
                "unique_blocks": unique, "reusable_share": (refs - unique) / refs if refs else 0.0}


def load(path: str | Path, fmt: TraceFormat | None = None, block_tokens: int | None = None) -> Trace:
    """Read a trace file (or, for SGLang logs, a directory of them). ``fmt`` None: guessed from the first
    record. ``block_tokens``: the trace's block (Mooncake: 512) or the page size to cut SGLang prompts into."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    if not files or not all(f.exists() for f in files):
        raise TraceError(f"{path}: no trace file there")
    records = list(_records(files))
    if not records:
        raise TraceError(f"{path}: no records")
    if fmt is None:
        fmt = TraceFormat.MOONCAKE if "hash_ids" in records[0][2] else TraceFormat.SGLANG
    if block_tokens is not None and block_tokens < 1:
        raise TraceError(f"block_tokens: must be >= 1, got {block_tokens}")
    if fmt is TraceFormat.MOONCAKE:
        return _mooncake(records, block_tokens or MOONCAKE_BLOCK_TOKENS, str(path))
    return _sglang(records, block_tokens or 64, str(path))


def _records(files: Iterable[Path]) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """(file, line number, object) of every JSON object in the files; a log line's prefix before its first
    ``{`` is skipped (SGLang's log targets may add one); blank lines are skipped."""
    for f in files:
        with f.open(encoding="utf-8") as fh:
            for no, line in enumerate(fh, 1):
                start = line.find("{")
                if start < 0:
                    continue
                try:
                    obj = json.loads(line[start:])
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{f}:{no}: not JSON ({exc.msg})") from None
                if isinstance(obj, dict):
                    yield f, no, obj


def _field(obj: dict[str, Any], name: str, where: str, kind: type | tuple[type, ...]) -> Any:
    value = obj.get(name)
    if value is None or isinstance(value, bool) or not isinstance(value, kind):
        raise TraceError(f"{where}: {name}: expected {getattr(kind, '__name__', kind)}, got {value!r}"[:300])
    return value


def _mooncake(records: list[tuple[Path, int, dict[str, Any]]], block: int, source: str) -> Trace:
    out = []
    for f, no, obj in records:
        where = f"{f}:{no}"
        ts = _field(obj, "timestamp", where, (int, float))
        n_in = _field(obj, "input_length", where, int)
        n_out = _field(obj, "output_length", where, int)
        ids = _field(obj, "hash_ids", where, list)
        if n_in < 0 or n_out < 0 or not math.isfinite(ts):
            raise TraceError(f"{where}: input_length, output_length and timestamp must be finite and >= 0")
        if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
            raise TraceError(f"{where}: hash_ids: expected integers")
        if len(ids) != math.ceil(n_in / block):
            raise TraceError(f"{where}: hash_ids: {len(ids)} blocks for input_length {n_in} "
                             f"(blocks of {block} tokens need {math.ceil(n_in / block)})")
        out.append(TraceRequest(ts / 1000.0, n_in, n_out, tuple(ids)))
    return ordered(out, block, source)


def _sglang(records: list[tuple[Path, int, dict[str, Any]]], block: int, source: str) -> Trace:
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    out = []
    for f, no, obj in records:
        if obj.get("event") != "request.finished":
            continue
        where = f"{f}:{no}"
        req = _field(obj, "obj", where, dict)
        meta = _field(_field(obj, "out", where, dict), "meta_info", where + ": out", dict)
        tokens = req.get("input_ids")
        if not isinstance(tokens, list) or not tokens:
            raise TraceError(f"{where}: obj.input_ids: missing; log with --log-requests-level 3 and send "
                             "token ids (a text prompt's tokens are not in the log)")
        if isinstance(tokens[0], list):
            raise TraceError(f"{where}: obj.input_ids: a batch request; send one prompt per request")
        try:
            finished = datetime.fromisoformat(_field(obj, "timestamp", where, str)).timestamp()
        except ValueError:
            raise TraceError(f"{where}: timestamp: not an ISO time: {obj['timestamp']!r}") from None
        latency = float(meta.get("e2e_latency") or 0.0)
        n_out = int(meta.get("completion_tokens") or 0)
        out.append(TraceRequest(finished - latency, len(tokens), n_out, chain_blocks(tokens, block, ids)))
    if not out:
        raise TraceError(f"{source}: no request.finished events (SGLang's --log-requests-format json)")
    return ordered(out, block, source)


def chain_blocks(tokens: list[int], block: int, ids: dict[tuple[int, tuple[int, ...]], int]) -> tuple[int, ...]:
    """Block ids of a prompt cut into ``block`` tokens: each named by its parent's id and its own tokens
    (``ids`` maps those to ids, shared across the prompts of one trace), so equal ids mean equal prefixes."""
    chain, parent = [], -1
    for i in range(0, len(tokens), block):
        parent = ids.setdefault((parent, tuple(tokens[i:i + block])), len(ids))
        chain.append(parent)
    return tuple(chain)


def ordered(requests: list[TraceRequest], block: int, source: str) -> Trace:
    """A trace of ``requests`` sorted by arrival, arrivals from 0."""
    requests.sort(key=lambda r: r.arrival_s)
    t0 = requests[0].arrival_s if requests else 0.0
    return Trace(tuple(TraceRequest(r.arrival_s - t0, r.input_tokens, r.output_tokens, r.blocks) for r in requests),
                 block, source)
