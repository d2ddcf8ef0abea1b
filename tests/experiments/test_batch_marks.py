"""The marks of batches that ran with streamed tails: taken once, bounded, inert without a scheduler."""

from __future__ import annotations

from types import SimpleNamespace

from sgl_kvtier.experiments.streaming.hooks import batch_marks as batch_marks


def test_a_mark_is_taken_once_and_only_for_its_forward():
    scheduler, batch = SimpleNamespace(), SimpleNamespace(forward_iter=7)
    batch_marks.note_batch(scheduler, batch, waits=0, seconds=0.0, tail_bytes=0)  # no tails, no wait: no mark
    assert batch_marks.take(scheduler, batch) is None
    batch_marks.note_batch(scheduler, batch, waits=2, seconds=0.5, tail_bytes=4096)
    assert batch_marks.take(scheduler, SimpleNamespace(forward_iter=8)) is None
    mark = batch_marks.take(scheduler, batch)
    assert mark == batch_marks.Mark(2, 0.5, 4096) and mark.stalled
    assert batch_marks.take(scheduler, batch) is None  # taken once


def test_a_batch_with_tails_that_never_waited_is_marked_not_stalled():
    scheduler, batch = SimpleNamespace(), SimpleNamespace(forward_iter=3)
    batch_marks.note_batch(scheduler, batch, waits=0, seconds=0.0, tail_bytes=1 << 20)
    mark = batch_marks.take(scheduler, batch)
    assert mark is not None and not mark.stalled and mark.tail_bytes == 1 << 20


def test_marks_are_bounded_oldest_first_and_odd_inputs_are_not_marked():
    scheduler = SimpleNamespace()
    for i in range(batch_marks.MAX_MARKS + 3):
        batch_marks.note_batch(scheduler, SimpleNamespace(forward_iter=i), waits=1, seconds=0.1, tail_bytes=1)
    marks = scheduler.__dict__[batch_marks.MARKS_ATTR]
    assert len(marks) == batch_marks.MAX_MARKS and min(marks) == 3
    assert batch_marks.take(None, SimpleNamespace(forward_iter=5)) is None  # no scheduler (a caller's test double)
    assert batch_marks.take(scheduler, SimpleNamespace(forward_iter=None)) is None
