"""Retract a request right after a forward whose KV must not count, and requeue it safely (issue #13, §3).

A streamed tail that was zero-filled (a group failed to read, failed its checksum or missed its deadline)
makes its request's forward worthless: the request is *retracted*, with SGLang's own retract semantics,
and recomputes as if it had never streamed. ``retract(scheduler, batch, req, reason=...)`` is called on
the scheduler thread from an AFTER hook of ``Scheduler.run_batch`` (the verdict of ``stream_load``, or
the testing knob below), i.e. after the forward was launched and before its result is processed:

1. ``scheduler.chunked_req`` is cleared if it is ``req``: otherwise the next ``get_next_batch_to_run``
   would ``stash_chunked_request`` it (``scheduler.py:3911-3919``), inserting the worthless chunk's KV
   into the tree, and schedule its next chunk.
2. ``release_req`` (``schedule_batch.py:2360-2395``) with ``offload_kv=False``:
   ``release_kv_cache(req, checkpoint=False)`` gives back every slot the request owns (the suffix, and a
   streamed tail: ``[cache_protected_len, kv_allocated_len)``), unlocks its tree path and frees its row;
   nothing reaches the tree. Then ``req.reset_for_retract()`` (``:2049-2101``) sets ``is_retracted``,
   which makes result processing drop this forward's output (``batch_result_processor.py:307-348``: no
   token, no checkpoint), and keeps ``output_ids`` so the request re-prefills the same sequence.
3. ``req`` waits in the scheduler's retract list (``PENDING_ATTR``). BEFORE ``get_next_batch_to_run``
   (``before_next_batch``) it is filtered out of ``last_batch`` and ``running_batch`` (``filter_batch``
   keeps every unfinished request, ``schedule_batch.py:3834-3849``, and ``get_next_batch_to_run`` would
   merge it for decode, ``scheduler.py:3934-3961``), and it is requeued with
   ``_add_request_to_queue(req, is_retracted=True)`` (``scheduler.py:3480-3493``, as ``retract_decode``'s
   caller does at ``:4540``) only once no batch still waiting in ``result_queue`` holds it. Ordering:
   requeuing earlier would let ``prepare_for_extend`` clear ``is_retracted`` (``schedule_batch.py:2996``)
   before the overlap loop processes the worthless result, which would then be committed. In the normal
   loop (``scheduler.py:2026-2059``) the result is processed inside the same step, so the next step
   requeues; in the overlap loop (``:2061-2134``) the step after that.

If ``req`` cannot be retracted (finished, no KV, a decode row of a mixed batch, not an EXTEND/MIXED
forward) nothing is released: the caller falls back to ``abort`` (SGLang's linker-failure semantics,
``unified_radix_cache.py:3631-3649``: the output is discarded, the KV never inserted, HTTP 503), never to
committing the output. Nothing here raises into SGLang: failures are logged and counted (the backend's
``ErrorBoundary``; SGLang's own ``num_retracted_requests_total`` counts every retract too).

Known limit (SGLang's): result processing skips a retracted request before its input-logprob rows are
consumed (``batch_result_processor.py:343-348`` ``continue`` before ``_apply_prefill_logprobs``, a running
offset), so another request of the same batch asking for input logprobs would read shifted rows.

Testing only: ``KVTIER_TEST_RETRACT=<prefix>`` (like the ``fault_injection`` config table, never for
production) retracts every request whose rid starts with ``<prefix>`` after its first prefill forward
(never a second time), streamed or not: the path above, on a real server, without any fault.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

from sgl_kvtier.telemetry.counters import ErrorBoundary

logger = logging.getLogger(__name__)

RUN_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"
NEXT_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run"
ENV_TEST = "KVTIER_TEST_RETRACT"  # testing only: a rid prefix: retract those requests' first forward
PENDING_ATTR = "_kvtier_retracted"  # on the Scheduler: requests retracted, waiting to be requeued
RETRACTABLE_MODES = frozenset({"EXTEND", "MIXED"})


def _boundary(scheduler: Any) -> ErrorBoundary:
    """Where a failure here is counted: the backend's boundary (``stream_copy.boundary_of``)."""
    from sgl_kvtier.experiments.streaming.hooks.copy import boundary_of

    return boundary_of(getattr(scheduler, "tree_cache", None))


@dataclasses.dataclass
class RetractStats:
    """What the retract path did in this process."""

    retracted: int = 0  # requests retracted after a forward (their output dropped, KV released)
    requeued: int = 0  # of those, put back in the waiting queue
    aborted: int = 0  # requests that could not be retracted and were aborted instead (503)
    test_retracts: int = 0  # retracts asked by KVTIER_TEST_RETRACT


STATS = RetractStats()
_stats_lock = threading.Lock()


def stats() -> dict[str, int]:
    """A copy of this process's retract counters."""
    with _stats_lock:
        return dataclasses.asdict(STATS)


def _count(field: str) -> None:
    with _stats_lock:
        setattr(STATS, field, getattr(STATS, field) + 1)


# ---------------------------------------------------------------------------------------------- retract
def retractable(batch: Any, req: Any) -> str | None:
    """Why ``req`` cannot be retracted after ``batch``'s forward (None: it can)."""
    mode = getattr(getattr(batch, "forward_mode", None), "name", None)
    if mode not in RETRACTABLE_MODES:
        return f"forward mode {mode}"
    if req not in batch.reqs:
        return "not in the batch"
    if batch.decoding_reqs and req in batch.decoding_reqs:
        return "a decode row of a mixed batch"
    if req.finished():
        return "already finished"
    if not req.kv.holds_kv:
        return "holds no KV"
    return None


def pending(scheduler: Any) -> list[Any]:
    """The scheduler's retracted requests waiting to be requeued (made on first use)."""
    out: list[Any] | None = scheduler.__dict__.get(PENDING_ATTR)
    if out is None:
        out = []
        scheduler.__dict__[PENDING_ATTR] = out
    return out


def retract(scheduler: Any, batch: Any, req: Any, *, reason: str) -> bool:
    """Retract ``req`` after ``batch``'s forward (scheduler thread, AFTER ``run_batch``); True if done.

    False: ``req`` was left as it was (see ``retractable``); the caller must ``abort`` it if its output
    must not be committed.
    """
    from sglang.srt.managers.schedule_batch import release_req

    why_not = retractable(batch, req)
    if why_not is not None:
        logger.error("kvtier stream: cannot retract request %s (%s): %s", req.rid, reason, why_not)
        return False
    # Before the release: the next step's stash of the chunked request would insert this chunk's KV.
    if scheduler.chunked_req is req:
        scheduler.chunked_req = None
    release_req(req=req, remaing_req_count=0, req_to_token_pool=scheduler.req_to_token_pool,
                token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator,
                tree_cache=scheduler.tree_cache, hisparse_coordinator=scheduler.hisparse_coordinator,
                offload_kv=False)
    pending(scheduler).append(req)
    _count("retracted")
    _count_in_sglang(scheduler, req)
    logger.warning("kvtier stream: retracted request %s after its forward (%s): output dropped, KV released, "
                   "it recomputes", req.rid, reason)
    return True


def _count_in_sglang(scheduler: Any, req: Any) -> None:
    """SGLang's own retract counter (``sglang:num_retracted_requests_total``), as ``update_running_batch``
    counts its decode retracts (``scheduler.py:4502-4512``); best effort."""
    try:
        reporter = scheduler.metrics_reporter
        if reporter.enable_metrics:
            reporter.metrics_collector.increment_retracted_reqs(
                num_retracted_reqs=1, num_retracted_input_tokens=len(req.origin_input_ids),
                num_retracted_output_tokens=len(req.output_ids))
    except Exception as exc:
        _boundary(scheduler).fail("counting a retract in SGLang's metrics", exc, outcome="not counted there")


def abort(scheduler: Any, req: Any, *, reason: str) -> None:
    """Last resort when ``retract`` is impossible: drop the output, never insert the KV (HTTP 503)."""
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.skip_radix_cache_insert = True
    req.discard_output_reason = FINISH_ABORT(f"KV cache load failed ({reason})", HTTPStatus.SERVICE_UNAVAILABLE)
    if scheduler.chunked_req is req:  # released like a client abort, so its next chunk never runs
        scheduler._pending_chunked_abort_req = req
    _count("aborted")
    logger.error("kvtier stream: aborted request %s (%s): it could not be retracted", req.rid, reason)


def retract_or_abort(scheduler: Any, batch: Any, req: Any, *, reason: str) -> bool:
    """``retract``, else ``abort``; never raises. True if retracted."""
    try:
        if retract(scheduler, batch, req, reason=reason):
            return True
    except Exception as exc:
        _boundary(scheduler).fail(f"retract of request {req.rid}", exc, outcome="aborted instead")
        if req in pending(scheduler):
            return True  # released and reset: it will be requeued
    try:
        abort(scheduler, req, reason=reason)
    except Exception as exc:
        _boundary(scheduler).fail(f"abort of request {req.rid}", exc, outcome="left as is")
    return False


# ---------------------------------------------------------------------------------------------- requeue
def before_next_batch(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook (``get_next_batch_to_run``): keep retracted requests out of the batches, requeue them
    once no in-flight result holds them."""
    waiting = scheduler.__dict__.get(PENDING_ATTR)
    if not waiting:
        return None
    try:
        requeue_ready(scheduler, *args, **kwargs)
    except Exception as exc:
        _boundary(scheduler).fail("requeue of retracted requests", exc, outcome="retried at the next step")
    return None


def requeue_ready(scheduler: Any, running_batch: Any = None, last_batch: Any = None) -> list[Any]:
    """Filter ``pending(scheduler)`` out of both batches; requeue (and return) those no longer in flight."""
    waiting = pending(scheduler)
    for batch in (last_batch, running_batch):
        if batch is not None and any(req in waiting for req in batch.reqs):
            batch.filter_batch(keep_indices=[i for i, req in enumerate(batch.reqs) if req not in waiting])
            batch.batch_is_full = False
    in_flight = [b for b, _ in getattr(scheduler, "result_queue", None) or ()]  # the overlap loop's results
    ready = [req for req in waiting if not any(req in b.reqs for b in in_flight)]
    for req in ready:
        waiting.remove(req)
        scheduler._add_request_to_queue(req, is_retracted=True)
        _count("requeued")
        logger.info("kvtier stream: requeued retracted request %s", req.rid)
    return ready


# ---------------------------------------------------------------------------------------------- test knob
class RetractKnob:
    """``KVTIER_TEST_RETRACT``: retract the requests whose rid starts with this prefix, at their first forward."""

    def __init__(self, prefix: str) -> None:
        if not prefix:
            raise ValueError(f"{ENV_TEST} wants a request-id prefix")
        self.prefix = prefix

    def pick(self, batch: Any) -> list[Any]:
        """The requests of ``batch`` to retract now (never one already retracted: no retract loop)."""
        return [req for req in batch.reqs
                if str(req.rid).startswith(self.prefix) and not req.retraction_count
                and not (batch.decoding_reqs and req in batch.decoding_reqs)]


_knob: RetractKnob | None = None
_knob_read = False


def retract_knob() -> RetractKnob | None:
    """The knob of this process (read once; a bad value is logged and ignored)."""
    global _knob, _knob_read
    if not _knob_read:
        _knob_read = True
        prefix = os.environ.get(ENV_TEST, "").strip()
        if prefix:
            _knob = RetractKnob(prefix)
            logger.warning("kvtier stream: TESTING ONLY %s=%s: requests with that rid prefix are retracted after "
                           "their first prefill forward (pid %d)", ENV_TEST, prefix, os.getpid())
    return _knob


def knob_retract_after(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook (``run_batch``): the testing knob's retracts (inert unless ``KVTIER_TEST_RETRACT``)."""
    knob = retract_knob()
    if knob is None:
        return None
    try:
        mode = getattr(getattr(batch, "forward_mode", None), "name", None)
        if mode in RETRACTABLE_MODES:
            for req in knob.pick(batch):
                _count("test_retracts")
                retract_or_abort(scheduler, batch, req, reason=f"testing: {ENV_TEST}")
    except Exception as exc:
        _boundary(scheduler).fail("test retract", exc, outcome="not retracted")
    return None


HOOKS: list[tuple[str, Any, str]] = [
    (RUN_BATCH_TARGET, knob_retract_after, "AFTER"),
    (NEXT_BATCH_TARGET, before_next_batch, "BEFORE"),
]
