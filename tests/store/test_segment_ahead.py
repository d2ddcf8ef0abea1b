"""Segments made ahead of the put path: the first at open, the next once the upper half of the last one is in
use, never past the capacity; a failure made ahead reaches the put as "cannot grow"; nothing leaked on close."""

from __future__ import annotations

import errno
import threading

import pytest
from support import HostMemory, OSFaults, key, kvtier_threads, open_fds_under, open_store

from sgl_kvtier.store import devices
from sgl_kvtier.store.segment_ahead import SegmentAhead

BIG_PAGE = 256 * 1024 - 4096  # a 256 KiB slot with its trailer: four to a 1 MiB segment, the next made from the third


def segments(store) -> list[str]:
    return sorted(p.name for p in store.layout.arenas[0].dir.glob("seg-*.dat"))


def put(store, mem: HostMemory, first: int, n: int) -> list[bool]:
    return store.put([key(i) for i in range(first, first + n)], [mem.runs(i) for i in range(first, first + n)])


@pytest.fixture
def mem() -> HostMemory:
    m = HostMemory(16, BIG_PAGE)
    for i in range(16):
        m.fill(i, i)
    return m


def test_first_segment_at_open_next_from_the_upper_half_never_past_capacity(tmp_path, mem):
    before = kvtier_threads()
    with open_store(tmp_path, capacity_pages=16, page_bytes=BIG_PAGE) as store:
        store.layout.settle()
        assert segments(store) == ["seg-00000.dat"]  # made at open, before any put
        assert put(store, mem, 0, 2) == [True] * 2  # slots 0 and 1: the lower half
        store.layout.settle()
        assert segments(store) == ["seg-00000.dat"]
        assert put(store, mem, 2, 1) == [True]  # slot 2: the upper half, the next segment is made
        store.layout.settle()
        assert segments(store) == ["seg-00000.dat", "seg-00001.dat"]
        assert put(store, mem, 3, 13) == [True] * 13  # every slot of the four segments the capacity spans
        store.layout.settle()
        assert segments(store) == [f"seg-{n:05d}.dat" for n in range(4)]
    assert open_fds_under(tmp_path) == {} and kvtier_threads() - before == set()


def test_a_segment_failing_ahead_is_the_puts_cannot_grow(tmp_path, mem, monkeypatch):
    with open_store(tmp_path, capacity_pages=16, page_bytes=BIG_PAGE) as store:
        store.layout.settle()
        with monkeypatch.context() as m:
            m.setattr(devices, "os", OSFaults(errno.ENOSPC, {"open"}, "seg-00001"))
            assert put(store, mem, 0, 4) == [True] * 4  # slots 2 and 3 start making seg 1, which fails
            store.layout.settle()
            assert put(store, mem, 4, 2) == [False] * 2  # seg 1 cannot be made: the device is full
        assert store.stats().capacity_bytes == 4 * store.slot_bytes and store.counters.io_errors >= 1
        assert segments(store) == ["seg-00000.dat"]
        assert store.get([key(i) for i in range(4)], [mem.runs(i) for i in range(4)]) == [True] * 4


def test_close_joins_a_segment_being_made(tmp_path, monkeypatch):
    entered, go = threading.Event(), threading.Event()
    real = devices.fsync_dir

    def held_fsync(path):
        if threading.current_thread().name == "kvtier-segment":
            entered.set()
            go.wait()
        real(path)

    monkeypatch.setattr(devices, "fsync_dir", held_fsync)
    before = kvtier_threads()
    store = open_store(tmp_path, capacity_pages=16, page_bytes=BIG_PAGE)
    entered.wait()  # the first segment is being made, its descriptor not yet the arena's
    go.set()
    store.close()
    assert open_fds_under(tmp_path) == {} and kvtier_threads() - before == set()


def test_one_making_at_a_time_in_order_and_a_failure_handed_over_once():
    started, release = threading.Event(), threading.Event()
    made: list[int] = []

    def make(seg: int) -> None:
        made.append(seg)
        started.set()
        release.wait()
        if seg == 1:
            raise OSError(errno.ENOSPC, "full")
        if seg == 2:
            raise ValueError("a bug")

    ahead = SegmentAhead(make, "dev")
    ahead.start(1)
    started.wait()
    ahead.start(1)  # being made: not asked twice
    ahead.start(2)  # queued behind it, made by the same thread
    ahead.start(2)
    assert sum(t.name == "kvtier-segment" for t in threading.enumerate()) == 1
    release.set()
    ahead.wait()
    assert made == [1, 2]
    failure = ahead.failure(1)
    assert isinstance(failure, OSError) and failure.errno == errno.ENOSPC
    assert ahead.failure(1) is None  # handed over once: the put path tries again next time
    bug = ahead.failure(2)  # a bug on the thread becomes an EIO for the put path, never raised there
    assert isinstance(bug, OSError) and bug.errno == errno.EIO and "a bug" in str(bug)
    ahead.start(1)
    ahead.wait()
    assert made == [1, 2, 1]
    ahead.close()
    ahead.start(3)  # closed: nothing starts
    ahead.close()  # idempotent
    assert made == [1, 2, 1] and not any(t.name == "kvtier-segment" for t in threading.enumerate())
