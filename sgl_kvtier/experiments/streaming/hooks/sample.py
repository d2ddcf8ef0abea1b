"""Prefill samples for the T_hide gate while tails stream: the backend's prefill model is fed from the extend
batches' timing even when the cost policy plugin is off.

The gate (``hooks.admit.local_verdict``) predicts the suffix's compute with ``backend.cost.prefill.model()``;
without a model it falls back to its safe minimum. ``record_prefill`` (AFTER ``Scheduler.process_batch_result``)
calls ``cost_policy.plugin.record_prefill_timing`` for a batch when the cost policy plugin is not loaded in this
process (if it is, its own hook samples every batch: a second call would count each batch twice), the batch is
EXTEND or MIXED and streaming is active for ``scheduler.tree_cache``. That sampler leaves out a batch marked by
``batch_marks`` (it ran with streamed tails): one that waited on a tail group is no sample, one that never waited
is the bind rule's interference sample. Never raises into SGLang: a failure is counted on the backend's
``ErrorBoundary`` and the sample skipped.
"""

from __future__ import annotations

from typing import Any

from sgl_kvtier.experiments.streaming.hooks import batch_marks as batch_marks

BATCH_RESULT_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"


def record_prefill(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``process_batch_result``: one prefill sample for the gate's model (module docstring). Returns None
    (an AFTER hook's non-None value would replace SGLang's result)."""
    from sgl_kvtier.experiments.cost_policy import plugin as prefetch

    if prefetch.loaded():  # the cost plugin samples this batch itself
        return None
    mode = getattr(getattr(batch, "forward_mode", None), "name", None)
    if mode not in prefetch.PREFILL_MODES:
        return None
    cache = getattr(scheduler, "tree_cache", None)
    try:
        from sgl_kvtier.experiments.streaming.hooks import core as stream_core

        if stream_core.active(cache) is None:
            batch_marks.take(scheduler, batch)  # none lingers
            return None
    except Exception as exc:
        from sgl_kvtier.experiments.streaming.hooks.core import boundary

        boundary(cache).fail("streamed tails: prefill sample", exc, outcome="sample skipped")
        return None
    prefetch.record_prefill_timing(result, scheduler, batch, *args, **kwargs)  # never raises
    return None


HOOKS: list[tuple[str, Any, str]] = [
    (BATCH_RESULT_TARGET, record_prefill, "AFTER"),
]
