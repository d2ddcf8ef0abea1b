"""SGLang general plugin: the L3 prefetch stop decision by the load-or-recompute cost model.

Switched on by ``KVTIER_PREFETCH_POLICY=cost`` through the ``kvtier`` entry point; off, ``load()`` returns before it
imports anything from SGLang. The hooks hold no policy state: each uses the ``CostPolicy`` of our backend behind
the object it hooks (``prefill_samples.backend_of``). AROUND ``UnifiedRadixCache._can_terminate_prefetch``: the
stop decision (``can_terminate_prefetch``); AFTER ``Scheduler.process_batch_result``: a prefill sample of every
extend batch for the backend's ``cost.prefill`` (``record_prefill_timing``: ``sgl_kvtier.sglang.prefill_samples``,
whose batch observers take out the batches another plugin samples otherwise). It imports no other experiment.

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

from sgl_kvtier.policy.cost_inputs import PolicyMode
from sgl_kvtier.policy.cost_model import LoadProgress, RequestShape, should_terminate
from sgl_kvtier.sglang import prefill_samples
from sgl_kvtier.sglang.plugins import HookSpec, register_all
from sgl_kvtier.sglang.prefill_samples import BATCH_RESULT_TARGET, backend_of
from sgl_kvtier.telemetry.counters import ErrorBoundary

if TYPE_CHECKING:
    from sgl_kvtier.sglang.storage import KVTierStorage

logger = logging.getLogger(__name__)

TERMINATE_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._can_terminate_prefetch"

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
    prefill_samples.sample_every_batch()  # another plugin's sampling hook leaves every batch to this one
    _loaded = True
    logger.info("sgl_kvtier cost prefetch policy on in pid %d (hooks registered on %s, %s)", os.getpid(),
                TERMINATE_TARGET, BATCH_RESULT_TARGET)


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
    """AFTER hook on ``Scheduler.process_batch_result``: one prefill sample per extend batch, into the prefill
    sampler of the backend behind ``scheduler.tree_cache`` (``prefill_samples.record``: a batch an observer
    declines is none). Returns None (an AFTER hook's non-None value would replace SGLang's result); never raises."""
    prefill_samples.record(scheduler, batch)
