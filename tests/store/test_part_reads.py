"""``store.part_reads.PartRead``: a group started while another is read is queued behind it and begun by the
read's own thread as soon as the one before ended (no hand-back to the caller in between), for the pages
still hits; ``close`` drops a group still queued (no IO for it) and waits for the one in flight.

No test sleeps to synchronise: a group's IO is held in the engine on a ``threading.Event``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest
from support import EngineWrapper, HostMemory, flip, key, namespace, store_config
from thread_kit import BOUND_S, finished, start

from sgl_kvtier.io.engine import IOOp, IOResult
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.page_store import PageStore
from sgl_kvtier.store.part_reads import PartRead
from sgl_kvtier.store.transfer import ReadVerdict

PAGE, PART, N = 16384, 4096, 6
PLAN = [(0,), (1,), (2,), (3,)]


class Held(EngineWrapper):
    """Holds batch ``hold`` (0-based, counted from the last ``batches.clear()``; -1: none) until ``release``;
    records each batch's thread and op count."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = -1
        self.entered, self.release = threading.Event(), threading.Event()
        self.batches: list[tuple[int, int]] = []  # (thread ident, ops)

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        index = len(self.batches)
        self.batches.append((threading.get_ident(), len(ops)))
        if index == self.hold:
            self.entered.set()
            assert self.release.wait(BOUND_S)
        return self.inner.run(ops)


@pytest.fixture
def held(tmp_path) -> Iterator[tuple[PageStore, HostMemory, list[bytes], Held]]:
    """A store of ``N`` four-part pages (their bytes expected back), the host memory cleared, and its engine
    set to hold the next read's first group; closed after the test."""
    engine = Held()
    cfg = store_config(tmp_path, page_bytes=PAGE, capacity_bytes=4 * N * fmt.slot_bytes_for(PAGE, 4))
    with PageStore.open(cfg, namespace(PAGE, parts=(PART,) * 4), engine=engine) as store:
        mem = HostMemory(N, PAGE)
        expected = [mem.fill(i, 40 + i) for i in range(N)]
        assert store.put([key(i) for i in range(N)], [mem.runs(i) for i in range(N)]) == [True] * N
        mem.clear()
        engine.batches.clear()
        engine.hold = 0  # the read's first group
        yield store, mem, expected, engine


def two_started(store: PageStore, mem: HostMemory, engine: Held) -> PartRead:
    """A read of every page with group 0 held in flight and group 1 started behind it (queued: no second
    batch yet, and group 0's verdicts not known)."""
    read = store.part_read([key(i) for i in range(N)], [mem.runs(i) for i in range(N)], PLAN)
    read.start(0)
    assert engine.entered.wait(BOUND_S)
    read.start(1)
    assert len(engine.batches) == 1
    return read


def test_a_group_started_behind_another_is_begun_by_the_reads_thread_when_that_one_ends(held) -> None:
    store, mem, expected, engine = held
    read = two_started(store, mem, engine)
    engine.hold, engine.entered = 1, threading.Event()  # now hold group 1 as it begins
    engine.release.set()
    # Group 1 begins with the caller nowhere near: nobody has called finish for group 0.
    assert engine.entered.wait(BOUND_S)
    assert [t for t, _ in engine.batches] == [engine.batches[0][0]] * 2  # on the read's one thread
    ok = [False] * N
    read.finish(ok)  # group 0 landed meanwhile
    assert ok == [True] * N
    read.finish(ok)
    read.start(2)
    read.finish(ok)
    read.start(3)
    read.finish(ok)
    read.close()
    assert ok == [True] * N and read.verdicts == [ReadVerdict.HIT] * N
    assert [mem.page(i).tobytes() for i in range(N)] == expected and not store._slots._pins


def test_close_drops_a_queued_group_and_waits_for_the_one_in_flight(held) -> None:
    store, mem, _, engine = held
    read = two_started(store, mem, engine)
    closer, out = start(read.close)
    closer.join(0.2)
    assert closer.is_alive() and store._slots._pins  # waits for group 0, its slots still pinned
    engine.release.set()
    assert finished(closer) and out == [None]
    assert len(engine.batches) == 1  # group 1 never read
    assert read.verdicts == [ReadVerdict.SKIPPED] * N and not store._slots._pins
    assert len(store) == N and store.counters.corrupt_pages == 0  # not read whole: misses, pages kept


def test_a_page_failing_a_group_gets_no_io_in_the_group_queued_behind_it(held) -> None:
    store, mem, _, engine = held
    flip(store, key(2), 10)  # page 2's part 0 corrupt
    read = two_started(store, mem, engine)
    engine.release.set()
    ok = [False] * N
    read.finish(ok)
    assert ok == [i != 2 for i in range(N)]
    read.finish(ok)
    read.close()
    assert [n for _, n in engine.batches] == [N, N - 1]  # group 1 read without page 2
    assert read.verdicts[2] is ReadVerdict.CORRUPT
