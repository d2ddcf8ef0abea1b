"""``store.part_reads.PartRead``: the next group is sent while the one before is still in flight, so the
device has it queued and never idles between groups; it reads the pages still hits as far as the caller
knows, so a page failing in group g gets no IO from group g + 2 on; ``close`` waits for every group in
flight.

No test sleeps to synchronise: a group's IO is held in the engine on a ``threading.Event``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest
from support import EngineWrapper, HostMemory, flip, key, namespace, store_config
from thread_kit import BOUND_S, finished, start

from sgl_kvtier.io.engine import IOOp, IOResult
from sgl_kvtier.sharing.sites import open_writer
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
        self.second = threading.Event()  # set when a batch after the held one reaches the engine
        self.hold_also = -1  # a second batch held on the same release
        self.batches: list[tuple[int, int]] = []  # (thread ident, ops)
        self.groups: list[set[int | None]] = []  # per batch, its ops' read groups (``IOOp.group``)

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        index = len(self.batches)
        self.batches.append((threading.get_ident(), len(ops)))
        self.groups.append({op.group for op in ops})
        if index == self.hold:
            self.entered.set()
            assert self.release.wait(BOUND_S)
        elif index > self.hold >= 0:
            self.second.set()
            if index == self.hold_also:
                assert self.release.wait(BOUND_S)
        return self.inner.run(ops)


@pytest.fixture
def held(tmp_path) -> Iterator[tuple[PageStore, HostMemory, list[bytes], Held]]:
    """A store of ``N`` four-part pages (their bytes expected back), the host memory cleared, and its engine
    set to hold the next read's first group; closed after the test."""
    engine = Held()
    cfg = store_config(tmp_path, page_bytes=PAGE, capacity_bytes=4 * N * fmt.slot_bytes_for(PAGE, 4))
    with open_writer(cfg, namespace(PAGE, parts=(PART,) * 4), engine=engine) as store:
        mem = HostMemory(N, PAGE)
        expected = [mem.fill(i, 40 + i) for i in range(N)]
        assert store.put([key(i) for i in range(N)], [mem.runs(i) for i in range(N)]) == [True] * N
        mem.clear()
        engine.batches.clear()
        engine.groups.clear()
        engine.hold = 0  # the read's first group
        yield store, mem, expected, engine


def two_started(store: PageStore, mem: HostMemory, engine: Held) -> PartRead:
    """A read of every page with group 0 held in flight and group 1 sent beside it, group 0's verdicts not
    known yet."""
    read = store.part_read([key(i) for i in range(N)], [mem.runs(i) for i in range(N)], PLAN)
    read.start(0)
    assert engine.entered.wait(BOUND_S)
    read.start(1)
    return read


def test_the_next_group_is_in_flight_while_the_one_before_is_held(held) -> None:
    store, mem, expected, engine = held
    read = two_started(store, mem, engine)
    assert engine.second.wait(BOUND_S)  # group 1 reached the engine with group 0 still held
    assert [n for _, n in engine.batches] == [N, N]
    assert engine.batches[0][0] != engine.batches[1][0]  # on another part-read thread
    engine.release.set()
    ok = [False] * N
    read.finish(ok)
    assert ok == [True] * N
    for g in (2, 3):
        read.start(g)
        read.finish(ok)
    read.finish(ok)
    read.close()
    assert ok == [True] * N and read.verdicts == [ReadVerdict.HIT] * N
    assert [mem.page(i).tobytes() for i in range(N)] == expected and not store._slots._pins


def test_close_waits_for_every_group_in_flight(held) -> None:
    store, mem, _, engine = held
    read = two_started(store, mem, engine)
    assert engine.second.wait(BOUND_S)
    closer, out = start(read.close)
    closer.join(0.2)
    assert closer.is_alive() and store._slots._pins  # waits for group 0, its slots still pinned
    engine.release.set()
    assert finished(closer) and out == [None]
    assert read.verdicts == [ReadVerdict.SKIPPED] * N and not store._slots._pins
    assert len(store) == N and store.counters.corrupt_pages == 0  # not read whole: misses, pages kept


def test_a_page_failing_group_0_is_in_group_1_sent_beside_it_and_not_in_group_2(held) -> None:
    store, mem, _, engine = held
    flip(store, key(2), 10)  # page 2's part 0 corrupt
    read = two_started(store, mem, engine)
    assert engine.second.wait(BOUND_S)
    engine.release.set()
    ok = [False] * N
    read.finish(ok)
    assert ok == [i != 2 for i in range(N)]
    read.start(2)  # after group 0 landed: without page 2
    read.finish(ok)
    read.finish(ok)
    read.close()
    assert [n for _, n in engine.batches] == [N, N, N - 1] and ok == [i != 2 for i in range(N)]
    assert engine.groups == [{0}, {1}, {2}]  # each op names its read group (fault injection aims by it)
    assert read.verdicts[2] is ReadVerdict.CORRUPT


def test_the_read_time_counts_overlapping_groups_once(held, monkeypatch) -> None:
    """Both groups held in flight over the same stretch: the seconds the store's read rates learn are the
    wall time the read had IO in flight (within the read's own span), not the groups' times summed."""
    store, mem, _, engine = held
    recorded: list[float] = []
    real = store.read_rates.record
    monkeypatch.setattr(store.read_rates, "record", lambda dev, nbytes, seconds, busy: (
        recorded.append(seconds), real(dev, nbytes, seconds, busy)))
    engine.hold_also = 1  # group 1 waits on the same release as group 0
    t0 = time.perf_counter()
    read = two_started(store, mem, engine)
    assert engine.second.wait(BOUND_S)
    threading.Event().wait(0.2)  # both held: time passes with two groups in flight (not a synchronisation)
    engine.release.set()
    ok = [False] * N
    for g in (2, 3):
        read.finish(ok)
        read.start(g)
    read.finish(ok)
    read.finish(ok)
    read.close()
    wall = time.perf_counter() - t0
    assert ok == [True] * N and len(recorded) == 1
    assert 0.2 <= recorded[0] <= wall  # summed, the two held groups alone would count 0.4


class ReportsWaits(threading.Event):
    """An event that reports the first wait on it (``waited``)."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.set()
        return super().wait(timeout)


def test_a_group_hands_its_io_over_only_after_the_group_before_it(held, monkeypatch) -> None:
    """Group 0 is slow to build its ops (held in ``_spans``) while group 1, sent beside it, has built its own:
    group 1 waits for group 0's turn, so the engine gets group 0's IO first."""
    store, mem, expected, engine = held
    engine.hold = -1  # nothing held in the engine
    read = store.part_read([key(i) for i in range(N)], [mem.runs(i) for i in range(N)], PLAN)
    building = threading.Event()
    real = read._spans

    def spans(k: int, parts: tuple[int, ...]) -> list:
        if parts == PLAN[0]:
            assert building.wait(BOUND_S)
        return real(k, parts)

    monkeypatch.setattr(read, "_spans", spans)
    read._turns[0] = turn0 = ReportsWaits()
    read.start(0)
    read.start(1)
    assert turn0.waited.wait(BOUND_S)  # group 1's ops are built: it waits for group 0's turn
    assert engine.batches == []
    building.set()
    ok = [False] * N
    read.finish(ok)
    for g in (2, 3):
        read.start(g)
        read.finish(ok)
    read.finish(ok)
    read.close()
    assert engine.groups == [{0}, {1}, {2}, {3}] and ok == [True] * N
    assert [mem.page(i).tobytes() for i in range(N)] == expected
