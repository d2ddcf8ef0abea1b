"""Marks of the batches whose forward waited on a streamed tail's layer group (issue #13), so that neither
prefill sampler (``stream_sample.record_prefill``, the cost plugin's ``prefetch.record_prefill_timing``)
fits such a batch's time as compute: the stall would come back as predicted compute.

A mark is ``scheduler.__dict__[STALLED_ATTR][forward_iter] = seconds`` (``forward_iter``: set by SGLang's
``run_batch`` and kept by ``ScheduleBatch.copy``, so the overlap loop's copy finds it); ``stalled`` takes it
when read, and at most ``MAX_MARKS`` are kept per scheduler (the oldest go first). No imports: both
samplers use it without importing each other.
"""

from __future__ import annotations

from typing import Any

STALLED_ATTR = "_kvtier_stream_stalled"  # on the Scheduler: forward_iter -> seconds its forward waited on tails
MAX_MARKS = 64


def note_stall(scheduler: Any, batch: Any, waits: int, seconds: float) -> None:
    """The forward of ``batch`` waited ``waits`` times (``seconds`` in all) on tail groups: not a sample."""
    forward_iter = getattr(batch, "forward_iter", None)
    if waits <= 0 or not isinstance(forward_iter, int):
        return
    marks: dict[int, float] = scheduler.__dict__.setdefault(STALLED_ATTR, {})
    marks[forward_iter] = seconds
    while len(marks) > MAX_MARKS:
        del marks[next(iter(marks))]  # the oldest first (insertion order)


def stalled(scheduler: Any, batch: Any) -> bool:
    """Whether ``batch``'s forward waited on a tail group (its mark is taken)."""
    marks: dict[int, float] | None = getattr(scheduler, "__dict__", {}).get(STALLED_ATTR)
    forward_iter = getattr(batch, "forward_iter", None)
    if not marks or not isinstance(forward_iter, int):
        return False
    return marks.pop(forward_iter, None) is not None
