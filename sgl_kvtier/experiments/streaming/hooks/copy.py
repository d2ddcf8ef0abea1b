"""The copies of one batch's streamed tails, layer by layer, gated on their read groups.

``StreamLoad`` is one batch's tails (a ``TailCopy`` each) behind one ``layer_gate.LayerLoad``: its layer ``l`` is done
once every tail's layer ``l`` holds verified bytes or zeros. At the first layer of read group g the loader asks
``stream.wait_group``: LANDED, the group's layers are copied with SGLang's own per-layer copy
(``layer_loader.plugin.layer_copier``); anything else (or a failed copy), they get zeros, never unverified bytes,
and the copy is marked ``failed``. The tail's ``state`` stays LOADING: states change on the scheduler thread only
(the verdict makes it POISONED). Waits are bounded by one deadline per tail (``deadline_s``), so a stalled device
costs one deadline, then zeros and a retract. Nothing here raises: failures are counted on the cache's boundary
(``boundary_of``) and end as zeros.

Testing only: ``KVTIER_STREAM_FAULT`` = ``N[:G]`` (or ``all[:G]``) makes the loader treat read group G (default 0) of
the N-th streamed tail started in this process (or of every one) as FAILED (never for production).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.experiments.layer_loader.layer_gate import LayerLoad
from sgl_kvtier.experiments.layer_loader.plugin import layer_copier
from sgl_kvtier.experiments.streaming.contract import GroupVerdict, StreamedTail, StreamRegistry
from sgl_kvtier.sglang.prefill_samples import backend_of
from sgl_kvtier.telemetry.counters import ErrorBoundary

logger = logging.getLogger(__name__)

ENV_FAULT = "KVTIER_STREAM_FAULT"  # testing only
DEADLINE_FACTOR = 4.0  # a tail's deadline: this many times its predicted remaining read time...
DEADLINE_MAX_S = 60.0  # ...at least the store's slow_io_s, at most this
SLOW_IO_S = float(cast(float, StoreConfig.__dataclass_fields__["slow_io_s"].default))  # without a backend of ours

BOUNDARY = ErrorBoundary(logger)  # where a cache has no backend of ours to count what we caught
ON_BLOCK: Callable[[int], None] | None = None  # tests: passed to every load's gate (a waiter about to block)


@dataclasses.dataclass
class StreamLoadStats:
    """What the tail loader did in this process."""

    loads: int = 0  # batches with streamed tails
    tails: int = 0
    layers_copied: int = 0  # (tail, layer) copies of verified bytes
    layers_zeroed: int = 0  # (tail, layer) zero-fills
    failed_groups: int = 0  # groups that failed (FAILED, TIMEOUT, failed copy, injected fault; a tail not prepared)
    timeouts: int = 0  # of those, deadlines passed (a tail's first failure only)
    injected: int = 0  # of those, KVTIER_STREAM_FAULT
    landed: int = 0  # tails whose verdict (over all ranks) was landed
    poisoned: int = 0  # tails retracted (or aborted) by the verdict
    blocked_waits: int = 0  # forward reads that waited for a layer in flight
    blocked_s: float = 0.0


STATS = StreamLoadStats()
_stats_lock = threading.Lock()


def stats() -> dict[str, Any]:
    """A copy of this process's tail-loader counters."""
    with _stats_lock:
        return dataclasses.asdict(STATS)


def add_stats(**deltas: float) -> None:
    with _stats_lock:
        for name, delta in deltas.items():
            setattr(STATS, name, getattr(STATS, name) + delta)


def boundary_of(cache: Any) -> ErrorBoundary:
    """Where our hooks on ``cache`` count what they catch: its backend's boundary (the backend's telemetry),
    else ``BOUNDARY``. Never raises."""
    try:
        backend = backend_of(cache)
    except Exception:  # noqa: BLE001 - the boundary of last resort must not fail itself
        backend = None
    return BOUNDARY if backend is None else backend.boundary


# ---------------------------------------------------------------------------------------------- fault knob
def fault_group(ordinal: int, spec: str | None = None) -> int | None:
    """The group ``KVTIER_STREAM_FAULT`` fails for the ``ordinal``-th tail (1-based), or None."""
    spec = os.environ.get(ENV_FAULT, "") if spec is None else spec
    if not spec.strip():
        return None
    which, _, group = spec.strip().partition(":")
    try:
        g = int(group) if group else 0
        if which != "all" and int(which) != ordinal:
            return None
    except ValueError:
        BOUNDARY.fail(f"{ENV_FAULT}={spec!r}", ValueError("want N[:G] or all[:G]"), outcome="ignored")
        return None
    return g


# ---------------------------------------------------------------------------------------------- one tail
class TailCopy:
    """One tail of a load: its transfers (prepared on the scheduler thread as ``HiCacheController.start_loading``
    prepares its own), its layer -> group map (covering the counter's layers exactly once), its group verdicts.
    A tail that cannot be prepared is poisoned at once and zero-filled."""

    def __init__(self, tail: StreamedTail, cc: Any, num_layers: int, deadline: float,
                 fault: int | None, boundary: ErrorBoundary = BOUNDARY) -> None:
        self.tail = tail
        self.boundary = boundary
        self.deadline = deadline
        self.fault = fault
        self.verdicts: dict[int, GroupVerdict] = {}
        self.group_of = [-1] * num_layers
        self._cc = cc
        self.transfers: list[Any] = []
        self.failed = False  # a group of this tail was zero-filled: its forward's output must be discarded
        self._copy: Callable[[int], None] | None = None
        try:
            self._prepare(num_layers)
        except Exception as exc:
            boundary.fail(f"streamed tail {tail.rid}: preparing its load", exc, outcome="zeros, retracted")
            self._copy = None
        if self._copy is None:
            self.poison(-1, GroupVerdict.FAILED)

    def _prepare(self, num_layers: int) -> None:
        from sglang.srt.managers.cache_controller import CacheOperation
        from sglang.srt.mem_cache.pool_host.base import shared_host_layout_domains

        tail, stream = self.tail, self.tail.stream
        if tail.device_indices is None or len(tail.device_indices) != len(tail.host_indices):
            raise ValueError(f"{len(tail.host_indices)} host slots vs device slots {tail.device_indices}")
        for g in range(stream.groups):
            for layer in stream.layers(g):
                if not 0 <= layer < num_layers or self.group_of[layer] != -1:
                    raise ValueError(f"group {g} layer {layer}: not a layer of {num_layers} or in two groups")
                self.group_of[layer] = g
        if -1 in self.group_of:
            raise ValueError(f"layer {self.group_of.index(-1)} is in no group of the stream")
        cc = self._cc
        op = CacheOperation(tail.host_indices, tail.device_indices, -1)  # as start_loading merges its ops
        host, device, pool_transfers = cc._move_op_indices(op)
        transfers = cc._l2_load_transfers(host, device, pool_transfers)
        if shared_host_layout_domains(t.host_pool for t in transfers):
            raise ValueError("a shared (compacting) host layout: not streamable")
        self.transfers = cc.l2_transfer_engine._prepare_transfers(transfers)
        self._copy = layer_copier(self.transfers, cc.l2_transfer_engine.io_backend)

    def poison(self, group: int, verdict: GroupVerdict) -> None:
        # Not ``tail.state``: that changes on the scheduler thread only (the verdict makes it POISONED);
        # until then the tail is LOADING for every scheduler-side hook (e.g. its row's prefix indices).
        self.failed = True
        if group >= 0:
            self.tail.failed_groups.append(group)
        add_stats(failed_groups=1, timeouts=int(verdict is GroupVerdict.TIMEOUT))

    def load_layer(self, layer: int) -> None:
        """Copy ``layer`` of this tail once its group landed, else zero it. Never raises."""
        g = self.group_of[layer] if self._copy is not None else -1
        if g >= 0 and g not in self.verdicts:
            first = not self.failed
            self.verdicts[g] = verdict = self._wait(g)
            if verdict is not GroupVerdict.LANDED:
                self.poison(g, verdict if first else GroupVerdict.FAILED)  # later: "not landed yet", no deadline
                if first:
                    logger.warning("kvtier stream: request %s: layer group %d %s; its layers get zeros and the "
                                   "request is retracted after the forward", self.tail.rid, g, verdict.value)
        if g >= 0 and self.verdicts[g] is GroupVerdict.LANDED and self._copy is not None:
            try:
                self._copy(layer)
                add_stats(layers_copied=1)
                return
            except Exception as exc:
                self.boundary.fail(f"streamed tail {self.tail.rid}: copy of layer {layer}", exc, outcome="zeros")
                self.verdicts[g] = GroupVerdict.FAILED
                self.poison(g, GroupVerdict.FAILED)
        self._zero(layer)

    def _wait(self, g: int) -> GroupVerdict:
        if self.fault == g:
            add_stats(injected=1)
            return GroupVerdict.FAILED
        # Poisoned already: only look (its output is discarded); else wait up to the tail's deadline.
        timeout = 0.0 if self.failed else max(0.0, self.deadline - time.monotonic())
        try:
            verdict = self.tail.stream.wait_group(g, self.tail.first_page, 0.0)  # a look: landed already?
            if verdict is not GroupVerdict.TIMEOUT or timeout <= 0.0:
                return verdict
            return self.tail.stream.wait_group(g, self.tail.first_page, timeout)
        except Exception as exc:
            self.boundary.fail(f"streamed tail {self.tail.rid}: wait for group {g}", exc, outcome="zeros")
            return GroupVerdict.FAILED

    def _zero(self, layer: int) -> None:
        try:
            if self.transfers:
                for t in self.transfers:
                    local = t.layer_mapper(layer) if t.layer_mapper is not None else layer
                    if local is not None:
                        zero_rows(t.device_pool, local, t.device_indices)
            elif self.tail.device_indices is not None:
                zero_rows(self._cc.mem_pool_device, layer, self.tail.device_indices)
            add_stats(layers_zeroed=1)
        except Exception as exc:  # the output is discarded anyway: the zeros only protect the batch's numerics
            self.boundary.fail(f"streamed tail {self.tail.rid}: zero-fill of layer {layer}", exc, outcome="left as is")


def zero_rows(device_pool: Any, layer: int, rows: Any) -> None:
    """Zero the bytes of ``rows`` (token slots) of one local layer of an MHA (K, V) or MLA (KV) device pool."""
    import torch

    if getattr(device_pool, "k_buffer", None) is not None and getattr(device_pool, "v_buffer", None) is not None:
        buffers = [device_pool.k_buffer[layer], device_pool.v_buffer[layer]]
    else:
        buffers = [device_pool.kv_buffer[layer]]
    for buf in buffers:
        buf.view(torch.uint8).index_fill_(0, rows.to(device=buf.device, dtype=torch.int64), 0)


# ---------------------------------------------------------------------------------------------- one batch
class StreamLoad:
    """The streamed tails of one batch, loaded layer by layer (``job``: the gate the forward waits on)."""

    def __init__(self, cache: Any, registry: StreamRegistry, tails: list[TailCopy], num_layers: int,
                 on_layer_done: Callable[[int], None] | None, boundary: ErrorBoundary = BOUNDARY) -> None:
        self.cache = cache
        self.boundary = boundary
        self.registry = registry
        self.tails = tails
        self._on_layer_done = on_layer_done
        tokens = sum(len(tc.tail.host_indices) for tc in tails)
        self.job = LayerLoad(num_layers, self._load_layer, self._layer_done, label=f"{len(tails)} streamed "
                             f"tail(s), {tokens} tokens", tokens=tokens, on_block=ON_BLOCK)

    def _load_layer(self, layer: int) -> None:
        for tc in self.tails:
            tc.load_layer(layer)

    def _layer_done(self, layer: int) -> None:
        if self._on_layer_done is not None:
            try:
                self._on_layer_done(layer)
            except Exception as exc:
                self.boundary.fail(f"layer event {layer}", exc, outcome="ignored")

    def blocked(self) -> tuple[int, float]:
        """(waits, seconds) the forward waited on the loader for tail bytes."""
        return self.job.blocked_waits, self.job.blocked_s

    def join(self) -> None:
        self.job.join()
        waits, seconds = self.blocked()
        add_stats(blocked_waits=waits, blocked_s=seconds)


def slow_io_of(cache: Any) -> float:
    """The ``slow_io_s`` of the backend behind ``cache`` (``SLOW_IO_S`` without one)."""
    backend = backend_of(cache)
    return float(backend.config.slow_io_s) if backend is not None else SLOW_IO_S


def deadline_s(tail: StreamedTail, slow_io_s: float, boundary: ErrorBoundary = BOUNDARY) -> float:
    """How long the loader may wait for ``tail``'s groups in all: ``DEADLINE_FACTOR`` x its predicted remaining
    read time, at least ``slow_io_s``, at most ``DEADLINE_MAX_S``."""
    try:
        rate = tail.stream.read_rate()
        predicted = tail.stream.remaining_bytes(tail.first_page) / rate if rate else 0.0
    except Exception as exc:
        boundary.fail(f"streamed tail {tail.rid}: read-time estimate", exc, outcome="slow_io_s")
        predicted = 0.0
    return min(max(slow_io_s, DEADLINE_FACTOR * predicted), DEADLINE_MAX_S)

