"""Prefill samples around streamed tails: the gate's prefill model is fed from the extend batches' timing even
when no other plugin samples them, and a batch that ran with streamed tails is never fitted as compute.

The gate (``hooks.admit.local_verdict``) predicts the suffix's compute with ``backend.cost.prefill.model()``;
without a model it falls back to its safe minimum. Both parts go through ``sgl_kvtier.sglang.prefill_samples``:

- ``observe_batch``, the batch observer the plugin's ``load`` adds (``install``), sees every batch sampled there,
  whichever hook hands it over. It takes the batch's mark (``batch_marks``, first, whatever the answer: none
  lingers), ends the bind rule's end-to-end hit timings (``batch_marks.first_tokens``, stalled batches included:
  a stall is the path's own cost) and declines a marked batch: one that waited on a tail group is no sample at
  all, one that never waited is the bind rule's interference sample (``StreamCosts.record_stream_forward``).
- ``record_prefill`` (AFTER ``Scheduler.process_batch_result``) hands a batch to ``prefill_samples.record`` when
  no other plugin's hook samples every batch (``every_batch_sampled``: a second call would count each batch
  twice), the batch is EXTEND or MIXED and streaming is active for ``scheduler.tree_cache``.

Never raises into SGLang: a failure is counted on the backend's ``ErrorBoundary`` and the sample skipped.
"""

from __future__ import annotations

from typing import Any

from sgl_kvtier.experiments.streaming.backend_side import require_side, side_of
from sgl_kvtier.experiments.streaming.hooks import batch_marks as batch_marks
from sgl_kvtier.sglang import prefill_samples
from sgl_kvtier.sglang.prefill_samples import BATCH_RESULT_TARGET


def observe_batch(scheduler: Any, batch: Any, backend: Any, now: float) -> bool:
    """A ``prefill_samples.BatchObserver``: whether ``batch`` (an extend batch whose result was handled at
    ``now``) stays a prefill sample of ``backend`` (None: no backend of ours, no sample). Never raises."""
    mark = batch_marks.take(scheduler, batch)  # first: the batch's mark is taken whatever the answer
    if backend is None:
        return False
    side = side_of(backend)  # None: a backend made before the plugin loaded
    try:  # the bind rule's end-to-end hit samples end here, stalled batches included (a stall is the path's cost)
        if side is not None:
            batch_marks.first_tokens(side.stream_costs, batch, mark, now)
    except Exception as exc:
        backend.boundary.fail("bind rule hit timing", exc, outcome="sample skipped")
    if mark is None:
        return True
    if mark.stalled:  # compute + a wait on streamed tails: fitted, it would be "compute"
        return False
    try:  # compute + the interference of its tails' landing and copies: the bind rule's sample, not a prefill
        # one (kept raw: judged against the prefill model of the moment it is used, ``StreamCosts``)
        require_side(backend).stream_costs.record_stream_forward(
            mark.tail_bytes, list(zip(batch.extend_lens, batch.prefix_lens)), now - batch.launch_ts)
    except Exception as exc:  # a timing sample must never break the scheduler loop
        backend.boundary.fail("prefill timing", exc, outcome="sample skipped")
    return False


def install() -> None:
    """Every batch ``prefill_samples.record`` is given from now on passes ``observe_batch`` (idempotent)."""
    prefill_samples.observe(observe_batch)


def record_prefill(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``process_batch_result``: one prefill sample for the gate's model (module docstring). Returns None
    (an AFTER hook's non-None value would replace SGLang's result)."""
    if prefill_samples.every_batch_sampled():  # another plugin's hook samples this batch
        return None
    mode = getattr(getattr(batch, "forward_mode", None), "name", None)
    if mode not in prefill_samples.PREFILL_MODES:
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
    prefill_samples.record(scheduler, batch)  # never raises
    return None


HOOKS: list[tuple[str, Any, str]] = [
    (BATCH_RESULT_TARGET, record_prefill, "AFTER"),
]
