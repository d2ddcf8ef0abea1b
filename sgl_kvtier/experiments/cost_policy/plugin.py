"""SGLang general plugin: the L3 prefetch stop decision by the load-or-recompute cost model.

Switched on by ``KVTIER_PREFETCH_POLICY=cost`` through the ``kvtier`` entry point; off, ``load()`` returns before it
imports anything from SGLang. The hooks hold no policy state: each uses the ``CostPolicy`` of our backend behind
the object it hooks (``backend_of``). AROUND ``UnifiedRadixCache._can_terminate_prefetch``: the stop decision
(``can_terminate_prefetch``); AFTER ``Scheduler.process_batch_result``: prefill samples for the backend's
``cost.prefill`` (``record_prefill_timing``).

Invariants: a loaded prefix is never cut; until the read path and the prefill speed are measured, or after an
exception in our code (counted on the backend's ``ErrorBoundary``), the local verdict is SGLang's own
``_prefetch_deadline_expired``; the collective always runs, so ranks never diverge; nothing raises into the
scheduler from the timing hook.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from sgl_kvtier.experiments.streaming.backend_side import require_side, side_of
from sgl_kvtier.experiments.streaming.hooks import batch_marks as batch_marks
from sgl_kvtier.policy.cost_inputs import PolicyMode
from sgl_kvtier.policy.cost_model import LoadProgress, RequestShape, should_terminate
from sgl_kvtier.sglang.plugins import HookSpec, register_all
from sgl_kvtier.telemetry.counters import ErrorBoundary

if TYPE_CHECKING:
    from sgl_kvtier.sglang.storage import KVTierStorage

logger = logging.getLogger(__name__)

TERMINATE_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._can_terminate_prefetch"
BATCH_RESULT_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
PREFILL_MODES = frozenset({"EXTEND", "MIXED"})

_loaded = False
_clock = time.monotonic  # replaceable in tests
_orphans = ErrorBoundary(logger)  # hook failures with no backend of ours to count them


def load() -> None:
    """Register both hooks (``KVTIER_PREFETCH_POLICY=cost``); idempotent within a process; both hooks or none."""
    global _loaded
    if _loaded or PolicyMode.from_environ() is not PolicyMode.COST:
        return
    hooks: list[HookSpec] = [(TERMINATE_TARGET, can_terminate_prefetch, "AROUND"),
                             (BATCH_RESULT_TARGET, record_prefill_timing, "AFTER")]
    if not register_all("cost_policy", hooks):
        return
    _loaded = True
    logger.info("sgl_kvtier cost prefetch policy on in pid %d (hooks registered on %s, %s)", os.getpid(),
                TERMINATE_TARGET, BATCH_RESULT_TARGET)


def loaded() -> bool:
    """Whether the cost policy's hooks are registered in this process (``KVTIER_PREFETCH_POLICY=cost``)."""
    return _loaded


def backend_of(cache: Any) -> KVTierStorage | None:
    """Our backend behind a HiCache tree: the cache's ``cache_controller.storage_backend``, SGLang's failure
    injector unwrapped (None: no HiCache, no L3 attached, or another backend)."""
    from sglang.srt.mem_cache import hicache_storage

    from sgl_kvtier.sglang.storage import KVTierStorage

    controller = getattr(cache, "cache_controller", None)  # absent or None: not a HiCache tree
    backend = getattr(controller, "storage_backend", None)  # None: no L3 attached (or detached)
    injector = getattr(hicache_storage, "HiCacheStorageFailureInjector", None)  # absent from older SGLang releases
    if injector is not None and isinstance(backend, injector):  # SGLANG_TEST_HICACHE_BACKEND_RANDOM_*
        backend = backend._backend
    return backend if isinstance(backend, KVTierStorage) else None


def _boundary(backend: KVTierStorage | None) -> ErrorBoundary:
    return _orphans if backend is None else backend.boundary


# ---------------------------------------------------------------------------------------------- stop decision
def can_terminate_prefetch(original: Any, cache: Any, operation: Any) -> bool:
    """AROUND hook: SGLang's ``timeout`` branch (its default stop policy) with ``cost_model.should_terminate`` as the
    local verdict instead of the static budget: stop as soon as waiting is predicted to end later than recomputing
    the unloaded rest now. The collective is the branch's own (PP0 decides, MAX over TP, broadcast along PP), so
    every rank gets the same answer. ``best_effort`` and ``wait_complete`` run SGLang's method unchanged."""
    if cache.prefetch_stop_policy != "timeout":
        return bool(original(cache, operation))
    import torch

    verdict = False
    if cache.pp_rank == 0:
        backend = backend_of(cache)
        try:
            verdict = local_verdict(cache, operation, backend)
        except Exception as exc:  # the collective below must run on every rank regardless
            _boundary(backend).fail("cost policy stop decision", exc, outcome="SGLang's timeout decides")
            verdict = bool(cache._prefetch_deadline_expired(operation))
    flag = torch.tensor(int(verdict), dtype=torch.int, device="cpu")
    cache._all_reduce(flag, torch.distributed.ReduceOp.MAX)
    return bool(flag.item() == 1)


def local_verdict(cache: Any, operation: Any, backend: KVTierStorage | None) -> bool:
    """This rank's answer: stop waiting for ``operation`` now?"""
    page = cache.page_size
    landed = operation.host_indices is not None and (
        operation.completed_tokens >= len(operation.hash_value) * page)
    if landed:
        return False  # the KV is in host memory: cutting would salvage nothing
    inputs = None if backend is None else backend.cost.inputs()
    if backend is None or inputs is None:
        return bool(cache._prefetch_deadline_expired(operation))  # not measured yet: SGLang's static budget
    now = _clock()
    shape, progress = request_state(operation, page, inputs.read.page_bytes, now)
    decision = should_terminate(shape, progress, inputs.read.device, inputs.prefill)
    if backend.cost.log_due(now):
        logger.info("kvtier cost inputs: %s", backend.cost_inputs())
    if decision.terminate:
        logger.info("kvtier cost policy: stop prefetch req=%s after %d of %d pages (%.2fs in): recompute now "
                    "%.3fs, best wait+compute %.3fs", getattr(operation, "request_id", "?"), progress.loaded_pages,
                    shape.hit_pages, progress.elapsed_s, decision.recompute_now_s, decision.ttft_s)
    return decision.terminate


def request_state(operation: Any, page_tokens: int, page_bytes: int, now: float) -> tuple[RequestShape, LoadProgress]:
    """The cost model's view of one of SGLang's ``PrefetchOperation`` objects.

    Before the rank-agreed hit is known (query pending: no host bounce and no hit count) the whole span is
    assumed stored: the most favourable case for loading, so a cut then is right whatever the hit.
    """
    span = int(operation.stats_requested_tokens or len(operation.token_ids))
    known = operation.host_indices is not None or operation.storage_hit_count > 0
    hit_pages = (operation.storage_hit_count if known else span) // page_tokens
    loaded = operation.completed_tokens // page_tokens if operation.host_indices is not None else 0
    shape = RequestShape(page_tokens, page_bytes, hit_pages, cached_tokens=int(operation.storage_start),
                         tail_tokens=max(span - hit_pages * page_tokens, 0))
    return shape, LoadProgress(loaded_pages=loaded, elapsed_s=max(0.0, now - operation.start_time))


# ---------------------------------------------------------------------------------------------- prefill timing
def record_prefill_timing(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``Scheduler.process_batch_result``: one prefill sample per extend batch, into the
    prefill sampler of the backend behind ``scheduler.tree_cache``. A batch that ran with streamed tails
    (``batch_marks``) is no prefill sample: stalled, none at all; else the bind rule's interference sample."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    if not isinstance(batch, ScheduleBatch) or batch.forward_mode is None or batch.launch_ts is None:
        return
    if batch.forward_mode.name not in PREFILL_MODES or not batch.extend_lens:
        return
    mark = batch_marks.take(scheduler, batch)  # first: the batch's mark is taken whatever the answer (none lingers)
    backend = backend_of(getattr(scheduler, "tree_cache", None))
    if backend is None:
        return
    now = _clock()
    side = side_of(backend)  # the stream plugin's side of this backend (None: the plugin is off)
    try:  # the bind rule's end-to-end hit samples end here, stalled batches included (a stall is the path's cost)
        if side is not None:
            batch_marks.first_tokens(side.stream_costs, batch, mark, now)
    except Exception as exc:
        backend.boundary.fail("bind rule hit timing", exc, outcome="sample skipped")
    if mark is not None and mark.stalled:  # compute + a wait on streamed tails: fitted, it would be "compute"
        return
    try:
        seconds = now - batch.launch_ts
        if mark is None:
            backend.cost.prefill.record_batch(list(batch.extend_lens), list(batch.prefix_lens), seconds)
            return
        # Compute + the interference of its tails' landing and copies: the bind rule's sample, not a prefill
        # one (kept raw: judged against the prefill model of the moment it is used, ``StreamCosts``).
        require_side(backend).stream_costs.record_stream_forward(
            mark.tail_bytes, list(zip(batch.extend_lens, batch.prefix_lens)), seconds)
    except Exception as exc:  # a timing sample must never break the scheduler loop
        backend.boundary.fail("prefill timing", exc, outcome="sample skipped")
