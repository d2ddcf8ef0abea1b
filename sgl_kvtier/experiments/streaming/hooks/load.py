"""Forward side of a streamed tail (``HOOKS``, registered by ``experiments.streaming.plugin``).

- **Start**, AROUND ``UnifiedRadixCache.ready_to_load_host_cache`` (the batch being built): SGLang's own load-backs,
  then a ``copy.StreamLoad`` for the tails ``take_queued`` gives, on a loader thread where SGLang's device module is
  ``torch.cpu`` (elsewhere the same loop runs here, on SGLang's H2D stream: untested).
- **Gate**, AROUND ``LayerDoneCounter.wait_until`` (every attention read of the device pool calls it first): while a
  load is in flight, block until it has done that layer, then SGLang's wait. Keyed on the layer alone, as the layer
  loader's gate; both may be on (each waits for its own loads, then calls the original).
- **Verdict**, AFTER ``Scheduler.run_batch``: join the batch's loads (no copy outlives the forward's step), mark the
  batch for the prefill samplers (``batch_marks``), then keep or retract each streamed request by a rank-agreed flag.

Every hook is a pass-through unless a load of ours is in flight (gate, verdict) or streaming is on for the cache
(start). Nothing raises into SGLang: failures are counted on the ``ErrorBoundary`` and end as poisoned tails (zeros,
retract), never as committed output.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from sgl_kvtier.experiments.streaming.contract import StreamedTail, StreamRegistry, TailState
from sgl_kvtier.experiments.streaming.hooks import accounting as stream_accounting
from sgl_kvtier.experiments.streaming.hooks import batch_marks as batch_marks
from sgl_kvtier.experiments.streaming.hooks import bind as stream_bind
from sgl_kvtier.experiments.streaming.hooks import retract as stream_retract
from sgl_kvtier.experiments.streaming.hooks.copy import (
    StreamLoad,
    TailCopy,
    add_stats,
    boundary_of,
    deadline_s,
    fault_group,
    logger,
    slow_io_of,
)
from sgl_kvtier.experiments.streaming.hooks.core import guard, kv_bytes, note_scheduler
from sgl_kvtier.telemetry.counters import ErrorBoundary

START_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.ready_to_load_host_cache"
WAIT_TARGET = "sglang.srt.managers.cache_controller.LayerDoneCounter.wait_until"
RUN_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"


def active(cache: Any) -> StreamRegistry | None:
    """The cache's registry if streaming is on for it (``core.active``, looked up at each call), else None."""
    from sgl_kvtier.experiments.streaming.hooks import core as stream_core

    registry: StreamRegistry | None = stream_core.active(cache)
    return registry


class InFlight:
    """The loads started and not yet joined, in start order (scheduler thread writes; the gate reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loads: list[StreamLoad] = []

    def __bool__(self) -> bool:
        return bool(self._loads)  # the gate's fast path: no lock

    def add(self, load: StreamLoad) -> None:
        with self._lock:
            self._loads.append(load)

    def loads(self) -> tuple[StreamLoad, ...]:
        with self._lock:
            return tuple(self._loads)

    def take(self, cache: Any) -> list[StreamLoad]:
        with self._lock:
            taken = [load for load in self._loads if load.cache is cache]
            self._loads = [load for load in self._loads if load.cache is not cache]
            return taken


IN_FLIGHT = InFlight()
_ordinal = 0  # streamed tails started in this process (KVTIER_STREAM_FAULT counts them)
_said_first = False


def ready_to_load_host_cache(original: Callable[..., Any], cache: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: SGLang's load-backs (timed: the bind rule's X), then this batch's streamed tails on the
    loader (``start``)."""
    queued, t0 = _load_back_tokens(cache), time.monotonic()
    p = original(cache, *args, **kwargs)
    seconds = time.monotonic() - t0
    try:
        registry = active(cache)
        if registry is not None and queued:
            stream_bind.sample_load_back(cache, queued, seconds)
        tails = registry.take_queued() if registry is not None else []
    except Exception as exc:
        boundary_of(cache).fail("stream: taking the queued tails", exc, outcome="none loaded")
        return p
    if registry is None or not tails:
        return p
    try:
        return start(cache, registry, tails, p)
    except Exception as exc:  # start() guards each step; this is a bug in it
        boundary = boundary_of(cache)
        boundary.fail("stream: starting the tail loader", exc, outcome="tails retracted")
        if not any(tc.tail in tails for load in IN_FLIGHT.loads() for tc in load.tails):
            # The verdict must still see them: a load of no layers whose tails are all poisoned.
            copies = [TailCopy(t, None, 0, 0.0, None, boundary) for t in tails]
            IN_FLIGHT.add(StreamLoad(cache, registry, copies, 0, None, boundary))
        return p


def _load_back_tokens(cache: Any) -> int:
    """Tokens SGLang's ``start_loading`` is about to copy host -> device (its ``load_queue``); 0 if unknown."""
    try:
        queue = getattr(getattr(cache, "cache_controller", None), "load_queue", None) or ()
        return sum(int(op.host_indices.numel()) for op in queue)
    except Exception:  # noqa: BLE001 - a timing sample must never break the scheduler: no sample
        return 0


def start(cache: Any, registry: StreamRegistry, tails: list[StreamedTail], p: int) -> int:
    """Start the load of ``tails`` for the batch being built; returns the layer counter's consumer index.

    With no load-back of SGLang's in the batch (``p < 0``) it first takes a producer of the counter, records its
    start event and fences the H2D stream, as ``start_loading`` does, on the scheduler thread before the forward
    launches; the forward consumes that index.
    """
    global _ordinal, _said_first
    import torch
    from sglang.srt.mem_cache import l2_transfer

    boundary = boundary_of(cache)
    cc = cache.cache_controller
    counter = cc.layer_done_counter
    if p < 0:  # no load-back of SGLang's in this batch: the forward consumes a producer of ours
        try:
            p = counter.update_producer()
            counter.events[p].start_event.record()
            if cc.load_fence_stream is not None:  # here, on the scheduler thread, before the forward launches
                cc.l2_transfer_engine.host_to_device_stream.wait_stream(cc.load_fence_stream)
        except Exception as exc:
            boundary.fail("stream: taking a layer counter producer", exc, outcome="no layer events")
            p = -1
    slow_io_s = slow_io_of(cache)
    now = time.monotonic()
    copies = []
    for tail in tails:
        _ordinal += 1
        copies.append(TailCopy(tail, cc, counter.num_layers, now + deadline_s(tail, slow_io_s, boundary),
                               fault_group(_ordinal), boundary))
    load = StreamLoad(cache, registry, copies, counter.num_layers, counter.events[p].complete if p >= 0 else None,
                      boundary)
    IN_FLIGHT.add(load)
    add_stats(loads=1, tails=len(tails))
    try:
        if l2_transfer.device_module is torch.cpu:
            load.job.start()  # the loader thread (or, without a thread, every layer here and now)
        else:  # not a supported route (CUDA): the same loop here, its copies on SGLang's H2D stream
            with l2_transfer.device_module.stream(cc.l2_transfer_engine.host_to_device_stream):
                load.job.finish()
    except Exception as exc:  # the load is in flight: the gate would wait for it forever
        boundary.fail("stream: starting the loader thread", exc, outcome="loaded synchronously")
        load.job.finish()  # never raises: each layer's copy catches its own failures
    if not _said_first:
        _said_first = True
        logger.info("kvtier stream: first streamed load: %s, %d layers, copies on a loader thread (pid %d)",
                    load.job.label, load.job.num_layers, os.getpid())
    return p


# ---------------------------------------------------------------------------------------------- gate
def wait_until(original: Callable[..., Any], counter: Any, threshold: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: layer ``threshold`` of every tail load in flight is done before SGLang's own wait."""
    if IN_FLIGHT:
        for load in IN_FLIGHT.loads():
            try:
                if isinstance(threshold, int) and not isinstance(threshold, bool):
                    load.job.wait(threshold)
                else:  # not a layer index we know: everything
                    load.job.join()
            except Exception as exc:  # our copy never raises: a bug
                load.boundary.fail("stream gate", exc, outcome="SGLang's wait only")
    return original(counter, threshold, *args, **kwargs)


# ---------------------------------------------------------------------------------------------- verdict
def after_run_batch(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook (``run_batch``): join this batch's tail loads and apply the rank-agreed verdict. Returns None
    (an AFTER hook's non-None value would replace SGLang's result)."""
    note_scheduler(scheduler)  # for the gate's and the bind's "others in the engine" (core.others_in_engine)
    if not IN_FLIGHT:
        return None
    try:
        loads = IN_FLIGHT.take(scheduler.tree_cache)
        for load in loads:
            load.join()
        if loads:
            # Before the verdict: a batch that ran with tails is no prefill sample (a stall, or interference);
            # one with a failed tail (zeros, a retract) is no sample of either kind: marked as if it stalled.
            copies = [tc for load in loads for tc in load.tails]
            blocked = [load.blocked() for load in loads]
            failed = any(tc.failed for tc in copies)
            waits = sum(w for w, _ in blocked) or int(failed)
            batch_marks.note_batch(scheduler, batch, waits, sum(s for _, s in blocked),
                                   kv_bytes(scheduler.tree_cache, sum(tc.tail.tokens for tc in copies)), failed)
            verdict(scheduler, batch, loads)
    except Exception as exc:
        boundary_of(scheduler.tree_cache).fail("stream verdict", exc, outcome="verdict skipped")
    return None


def verdict(scheduler: Any, batch: Any, loads: list[StreamLoad]) -> None:
    """DONE or retract each streamed request of ``batch`` (landed flags MIN-reduced over the ranks). Landed: DONE,
    its host slots deferred. Failed on any rank: POISONED, its stream cancelled and slots deferred, the request
    blocked from streaming again and retracted (else aborted)."""
    import torch

    cache = scheduler.tree_cache
    boundary = boundary_of(cache)
    tails = {tc.tail.rid: (tc, load.registry) for load in loads for tc in load.tails}
    reqs = [req for req in batch.reqs if req.rid in tails]  # the batch's order: the same on every rank
    local = [int(not tails[r.rid][0].failed) for r in reqs]
    flags = torch.tensor(local, dtype=torch.int32)
    if reqs:
        try:
            cache._all_reduce(flags, torch.distributed.ReduceOp.MIN)
        except Exception as exc:
            boundary.fail("stream verdict: rank agreement", exc, outcome="this rank's flags")
            flags = torch.tensor(local, dtype=torch.int32)
    landed = [bool(f) for f in flags.tolist()]
    for req, ok in zip(reqs, landed, strict=True):
        copy, registry = tails.pop(req.rid)
        tail = copy.tail
        try:
            registry.remove(req.rid)
            if ok:
                tail.state = TailState.DONE
                registry.defer_free(tail.stream, tail.host_indices)
                add_stats(landed=1)
                stream_accounting.settle(cache, tail, kept=True)  # last: a failure here is only a count
                continue
            tail.state = TailState.POISONED
            _release_stream(tail, registry, boundary)
            registry.block(req.rid)  # its retry loads the hit whole or recomputes: never streams again
            add_stats(poisoned=1)
            stream_accounting.settle(cache, tail, kept=False)
        except Exception as exc:
            boundary.fail(f"stream verdict of request {req.rid}", exc, outcome="retracted" if not ok else "kept")
            if ok:
                continue
        # Never raises; the output of a poisoned forward is dropped either way (retract, else abort).
        stream_retract.retract_or_abort(scheduler, batch, req,
                                        reason=f"streamed tail, failed layer groups {tail.failed_groups}")
    if reqs:
        logger.info("kvtier stream: verdict of a batch: %d landed, %d retracted (%s)", sum(landed),
                    len(landed) - sum(landed), ", ".join(f"{r.rid}={'landed' if ok else 'retracted'}"
                                                         for r, ok in zip(reqs, landed, strict=True)))
    for rid, (copy, registry) in tails.items():  # loaded for a batch that does not hold them: a bug
        tail = copy.tail
        boundary.fail(f"streamed tail {rid}", LookupError("its request is not in the batch that ran"),
                      outcome="dropped")
        registry.remove(rid)
        tail.state = TailState.DROPPED
        _release_stream(tail, registry, boundary)
        guard(cache, "prefetch accounting", "not counted",
              partial(stream_accounting.settle, cache, tail, kept=False))


def _release_stream(tail: StreamedTail, registry: StreamRegistry, boundary: ErrorBoundary) -> None:
    try:
        tail.stream.cancel()
    except Exception as exc:
        boundary.fail(f"streamed tail {tail.rid}: cancel", exc, outcome="reads run out")
    registry.defer_free(tail.stream, tail.host_indices)


HOOKS: list[tuple[str, Any, str]] = [
    (START_TARGET, ready_to_load_host_cache, "AROUND"),
    (WAIT_TARGET, wait_until, "AROUND"),
    (RUN_BATCH_TARGET, after_run_batch, "AFTER"),  # before the retract knob's AFTER hook: registration order
    *stream_retract.HOOKS,
]
