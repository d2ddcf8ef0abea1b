"""Retract a request right after a forward whose KV must not count, and requeue it safely.

A zero-filled streamed tail makes its request's forward worthless: the request is *retracted* with SGLang's own
retract semantics and recomputes as if it had never streamed. ``retract`` runs on the scheduler thread from an
AFTER hook of ``Scheduler.run_batch`` (``hooks.load``'s verdict, or the testing knob), after the forward was
launched and before its result is processed:

1. ``scheduler.chunked_req`` is cleared if it is ``req``: else ``get_next_batch_to_run`` would stash it
   (``stash_chunked_request``), inserting the worthless chunk's KV into the tree, and schedule its next chunk.
2. ``release_req(..., offload_kv=False)``: ``release_kv_cache(req, checkpoint=False)`` gives back every slot the
   request owns (a streamed tail included), unlocks its tree path and frees its row; nothing reaches the tree.
   ``Req.reset_for_retract`` then sets ``is_retracted``, which makes result processing drop this forward's output
   (``process_batch_result_prefill``: no token, no checkpoint), and keeps ``output_ids`` for the re-prefill.
3. ``req`` waits in the scheduler's retract list (``PENDING_ATTR``). BEFORE each ``get_next_batch_to_run`` it is
   filtered out of ``last_batch`` and ``running_batch`` (``filter_batch`` keeps every unfinished request and the
   next batch would merge it for decode) and requeued with ``_add_request_to_queue(req, is_retracted=True)`` (as
   ``update_running_batch``'s retracts are) only once no batch waiting in ``result_queue`` holds it. Ordering:
   requeued earlier, ``prepare_for_extend`` would clear ``is_retracted`` before the overlap loop processes the
   worthless result, which would then be committed. So it is requeued at the next step in
   ``event_loop_normal``, at the one after in ``event_loop_overlap``.

A request that cannot be retracted (finished, no KV, a decode row of a mixed batch, not an EXTEND / MIXED forward)
is left as it is and the caller aborts it (``abort``: output discarded, KV never inserted, HTTP 503, as
``UnifiedRadixCache.finish_external_linker_loads`` treats a failed load), never commits its output. Nothing raises
into SGLang: failures are counted on the backend's ``ErrorBoundary``. Known SGLang limit: result processing skips a
retracted request before its input-logprob rows are consumed, so another request of the same batch asking for
input logprobs reads shifted rows.

Testing only: ``KVTIER_TEST_RETRACT=<prefix>`` retracts every request whose rid starts with ``<prefix>`` after its
first prefill forward (never a second time), streamed or not: this path on a real server, without a fault.
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
    """Where a failure here is counted: the backend's boundary (``copy.boundary_of``)."""
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
    counts its decode retracts; best effort."""
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
