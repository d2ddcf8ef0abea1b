"""Prefill samples for the T_hide gate while tails stream (issue #13): the backend's prefill model is fed
from the extend batches' timing even when the cost plugin is off.

The gate (``stream_admit.local_verdict``, ``stream_gate.decide``) predicts the suffix's compute with
``backend.cost.prefill.model()``; without a model it falls back to "group 0 landed on every tail page".
Samples come from ``prefetch.record_prefill_timing`` (AFTER ``Scheduler.process_batch_result``,
``scheduler.py:5074``: from the batch's ``launch_ts``, set by ``run_batch`` at ``:4623``, to the end of its
result processing), which the cost plugin registers only with ``KVTIER_PREFETCH_POLICY=cost``.
``record_prefill`` (AFTER the same method) calls it for a batch when:

- the cost plugin is not loaded in this process (``prefetch.loaded()``, set by its ``load()``; a plugin that
  ``SGLANG_PLUGINS`` leaves out is never loaded): if it is, its own hook samples every batch, and a second
  call would count each batch twice;
- the batch is EXTEND or MIXED (tested first: this hook runs after every step, decode ones included), and
  streaming is active for ``scheduler.tree_cache`` (``stream_core.active``);
- it ran without streamed tails. ``stall_marks.note_batch`` (``stream_load``'s verdict, AFTER ``run_batch``,
  with the batch's joined loads) marks a batch that had some by its ``forward_iter`` (set by ``run_batch``,
  ``scheduler.py:4622``, and kept by ``ScheduleBatch.copy``, ``schedule_batch.py:4040``: the overlap loop
  processes a copy of the batch that ran). A batch whose forward waited on a tail group is compute plus
  stall: fitted as compute, the stall would come back as predicted compute and the gate would admit earlier,
  to stall more; it is no sample at all. One that never waited is compute plus its tails' interference: its
  time over the prefill model's prediction is the bind rule's sample (``StreamingSide.stream_costs``). Marks are
  taken when read and at most ``MAX_MARKS`` are kept per scheduler (a batch whose result is never processed
  cannot pile them up).

With the cost plugin on, its hook (``prefetch.record_prefill_timing``) reads the marks the same way.
Never raises into SGLang: a failure is counted on the backend's ``ErrorBoundary`` and the sample skipped.
"""

from __future__ import annotations

from typing import Any

from sgl_kvtier.experiments.streaming.hooks import stall_marks

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
            stall_marks.take(scheduler, batch)  # none lingers
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
