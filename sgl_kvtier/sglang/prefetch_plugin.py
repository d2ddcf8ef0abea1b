"""SGLang general plugin: the L3 prefetch stop decision by the load-or-recompute cost model.

Declared in pyproject.toml as the ``sglang.srt.plugins`` entry point ``kvtier_prefetch``. SGLang 0.5.23's
``load_plugins()`` runs ``load()`` early in each of its processes and then ``HookRegistry.apply_hooks()``.

Enabled only by ``KVTIER_PREFETCH_POLICY=cost`` (see ``throughput``). Off, ``load()`` returns before it
imports anything from SGLang: no hook is registered, no SGLang class is touched.

On, two hooks through SGLang's ``HookRegistry``:
- AROUND ``UnifiedRadixCache._can_terminate_prefetch`` (``unified_radix_cache.py:2294-2313``), called by
  ``check_prefetch_progress`` for every unfinished prefetch at each admission poll. Under SGLang's
  ``timeout`` stop policy (its default) the static budget (1 s + 0.25 s per 1k tokens) is replaced by
  ``cost_model.should_terminate``: stop as soon as waiting is predicted to end later than recomputing the
  unloaded rest now. The collective is the one SGLang's own ``timeout`` branch does (the verdict is
  taken on PP0, MAX-reduced over TP, then broadcast along PP), so every rank runs the same collectives
  and gets the same answer; the rest of ``check_prefetch_progress`` (marking the cut as a policy
  deadline, no retries, salvaging the landed batches) is SGLang's. Under ``best_effort`` and
  ``wait_complete`` (explicit operator choices) SGLang's method runs unchanged.
- AFTER ``Scheduler.process_batch_result``: each EXTEND / MIXED batch's ``launch_ts`` to the end of its
  result processing is a prefill sample (new and cached tokens per request) for ``throughput.PREFILL``.

Invariants: a loaded prefix (every hit page acknowledged) is never cut; until both the read path and
the prefill speed are measured, the local verdict is SGLang's own ``_prefetch_deadline_expired``; an
exception in the model falls back to that verdict too and the collective always runs (ranks never
diverge); nothing raises into the scheduler from the timing hook.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from sgl_kvtier.policy.cost_model import LoadProgress, RequestShape, should_terminate
from sgl_kvtier.sglang import throughput

logger = logging.getLogger(__name__)

TERMINATE_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._can_terminate_prefetch"
BATCH_RESULT_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
PREFILL_MODES = frozenset({"EXTEND", "MIXED"})

_loaded = False
_clock = time.monotonic  # replaceable in tests


def load() -> None:
    """Entry point for ``sglang.srt.plugins``; idempotent within a process."""
    global _loaded
    if _loaded or not throughput.policy_enabled():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TERMINATE_TARGET, can_terminate_prefetch, HookType.AROUND)
    HookRegistry.register(BATCH_RESULT_TARGET, record_prefill_timing, HookType.AFTER)
    _loaded = True
    logger.info("sgl_kvtier cost prefetch policy on in pid %d (hooks registered on %s, %s)", os.getpid(),
                TERMINATE_TARGET, BATCH_RESULT_TARGET)


# ---------------------------------------------------------------------------------------------- stop decision
def can_terminate_prefetch(original: Any, cache: Any, operation: Any) -> bool:
    """AROUND hook: SGLang's ``timeout`` branch with the cost model as the local verdict."""
    if cache.prefetch_stop_policy != "timeout":
        return original(cache, operation)
    import torch

    verdict = False
    if cache.pp_rank == 0:
        try:
            verdict = local_verdict(cache, operation)
        except Exception:  # the collective below must run on every rank regardless
            logger.exception("kvtier cost policy failed; SGLang's timeout decides")
            verdict = cache._prefetch_deadline_expired(operation)
    flag = torch.tensor(int(verdict), dtype=torch.int, device="cpu")
    cache._all_reduce(flag, torch.distributed.ReduceOp.MAX)
    return flag.item() == 1


def local_verdict(cache: Any, operation: Any) -> bool:
    """This rank's answer: stop waiting for ``operation`` now?"""
    page = cache.page_size
    landed = operation.host_indices is not None and (
        operation.completed_tokens >= len(operation.hash_value) * page)
    if landed:
        return False  # the KV is in host memory: cutting would salvage nothing
    backend = getattr(cache.cache_controller, "storage_backend", None)
    device, prefill = throughput.device_model(backend), throughput.prefill_model()
    geometry = throughput.page_geometry(backend)
    if device is None or prefill is None or geometry is None:
        return cache._prefetch_deadline_expired(operation)  # not measured yet: SGLang's static budget
    now = _clock()
    shape, progress = request_state(operation, page, geometry[1], now)
    decision = should_terminate(shape, progress, device, prefill)
    throughput.maybe_log_inputs(backend, now)
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
    """AFTER hook on ``Scheduler.process_batch_result``: one prefill sample per extend batch."""
    try:
        mode = getattr(getattr(batch, "forward_mode", None), "name", None)
        launched = getattr(batch, "launch_ts", None)
        if mode in PREFILL_MODES and launched is not None and batch.extend_lens:
            throughput.record_prefill_batch(list(batch.extend_lens), list(batch.prefix_lens),
                                            _clock() - launched)
    except Exception as exc:  # a timing sample must never break the scheduler loop
        logger.debug("kvtier: prefill sample skipped: %s: %s", type(exc).__name__, exc)
