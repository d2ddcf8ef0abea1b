"""Marks of the batches that ran with streamed tails, so that no prefill sample (``sgl_kvtier.sglang.prefill_samples``,
whichever plugin's hook hands the batch over) fits such a batch's time as compute: a forward that waited on a
tail's group (a stall) would come back as predicted compute and the gate would admit earlier, to stall more; one
that ran beside its tails' landing is compute plus their interference, the bind rule's sample instead
(``rules.bind``). ``hooks.sample.observe_batch`` reads them.

A mark is ``scheduler.__dict__[MARKS_ATTR][forward_iter]`` (``forward_iter`` is set by ``Scheduler.run_batch`` and
kept by ``ScheduleBatch.copy``, so the overlap loop's copy finds it); ``take`` removes it when read and at most
``MAX_MARKS`` are kept per scheduler, the oldest going first. The marks also end the bind rule's end-to-end timing
of a hit (``first_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_kvtier.experiments.streaming.rules.bind import BindVerdict

MARKS_ATTR = "_kvtier_stream_marks"  # on the Scheduler: forward_iter -> Mark
MAX_MARKS = 64


@dataclass(frozen=True)
class Mark:
    """What one batch's forward did with its streamed tails."""

    waits: int  # times the forward waited on a tail group
    stall_s: float  # seconds it waited in all
    tail_bytes: int  # bytes of the streamed tails the batch loaded
    failed: bool = False  # a tail of the batch failed (zeros were loaded; its request is retracted)

    @property
    def stalled(self) -> bool:
        """No sample of either kind (the forward waited on a group, or ran with a failed tail: ``hooks.load``)."""
        return self.waits > 0


def note_batch(scheduler: Any, batch: Any, waits: int, seconds: float, tail_bytes: int, failed: bool = False) -> None:
    """The forward of ``batch`` loaded ``tail_bytes`` of streamed tails and waited ``waits`` times
    (``seconds`` in all) on their groups; ``failed``: one of its tails failed (counted as a wait too)."""
    forward_iter = getattr(batch, "forward_iter", None)
    if (waits <= 0 and tail_bytes <= 0) or not isinstance(forward_iter, int):
        return
    marks: dict[int, Mark] = scheduler.__dict__.setdefault(MARKS_ATTR, {})
    marks[forward_iter] = Mark(max(waits, 0), seconds, max(tail_bytes, 0), failed)
    while len(marks) > MAX_MARKS:
        del marks[next(iter(marks))]  # the oldest first (insertion order)


def take(scheduler: Any, batch: Any) -> Mark | None:
    """``batch``'s mark, removed (None: it ran without streamed tails)."""
    marks: dict[int, Mark] | None = getattr(scheduler, "__dict__", {}).get(MARKS_ATTR)
    forward_iter = getattr(batch, "forward_iter", None)
    if not marks or not isinstance(forward_iter, int):
        return None
    return marks.pop(forward_iter, None)


def first_tokens(costs: Any, batch: Any, mark: Mark | None, now: float) -> None:
    """Requests of extend ``batch`` (its result handled at ``now``) that ``costs`` (the backend's ``StreamCosts``)
    is timing: their sample, or dropped. A sample needs the batch to hold that request alone, with its first token,
    and to have run as its path says (a streamed hit: with its tail, unfailed; a whole load: without tails);
    anything else drops it (a chunk with no first token yet too: its batch is not its whole forward)."""
    reqs = list(getattr(batch, "reqs", None) or ())
    alone = len(reqs) == 1
    shape = list(zip(batch.extend_lens, batch.prefix_lens)) if alone else None
    for req in reqs:
        rid = getattr(req, "rid", None)
        path = None if rid is None else costs.timing(rid)
        if path is None:
            continue
        ran_as_its_path = (mark is not None and not mark.failed) if path is BindVerdict.STREAM else mark is None
        valid = alone and ran_as_its_path and bool(getattr(req, "output_ids", None))
        costs.finish_hit(rid, now, shape if valid else None)
