"""The marks of batches whose forward waited on a streamed tail: taken once, bounded, inert without a scheduler."""

from __future__ import annotations

from types import SimpleNamespace

from sgl_kvtier.sglang.plugins import stall_marks


def test_a_mark_is_taken_once_and_only_for_its_forward():
    scheduler, batch = SimpleNamespace(), SimpleNamespace(forward_iter=7)
    stall_marks.note_stall(scheduler, batch, waits=0, seconds=0.0)  # never waited: no mark
    assert not stall_marks.stalled(scheduler, batch)
    stall_marks.note_stall(scheduler, batch, waits=2, seconds=0.5)
    assert not stall_marks.stalled(scheduler, SimpleNamespace(forward_iter=8))
    assert stall_marks.stalled(scheduler, batch) and not stall_marks.stalled(scheduler, batch)


def test_marks_are_bounded_oldest_first_and_odd_inputs_are_not_stalled():
    scheduler = SimpleNamespace()
    for i in range(stall_marks.MAX_MARKS + 3):
        stall_marks.note_stall(scheduler, SimpleNamespace(forward_iter=i), waits=1, seconds=0.1)
    marks = scheduler.__dict__[stall_marks.STALLED_ATTR]
    assert len(marks) == stall_marks.MAX_MARKS and min(marks) == 3
    assert not stall_marks.stalled(None, SimpleNamespace(forward_iter=5))  # no scheduler (a caller's test double)
    assert not stall_marks.stalled(scheduler, SimpleNamespace(forward_iter=None))
