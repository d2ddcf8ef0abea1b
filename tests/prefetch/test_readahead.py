"""Read-ahead staging over a real page store: served bytes, joining reads in flight, the budget, no leaks."""

from __future__ import annotations

import threading

import pytest
from support import PAGE_BYTES, HostMemory, key, namespace, slot_file, store_config

from sgl_kvtier.io.engine import IOOp, IOResult, OpKind, ThreadPoolEngine
from sgl_kvtier.prefetch import ReadAhead
from sgl_kvtier.sharing.sites import open_writer


class GatedEngine:
    """Reads wait for ``gate`` (writes pass): a test holds a staged read in flight as long as it likes."""

    name = "gated"

    def __init__(self):
        self.inner = ThreadPoolEngine(8)
        self.gate = threading.Event()
        self.gate.set()
        self.reads_started = threading.Semaphore(0)
        self.read_ops = 0

    def run(self, ops: list[IOOp]) -> list[IOResult]:
        if ops and ops[0].kind is OpKind.READ:
            self.read_ops += len(ops)
            self.reads_started.release()
            self.gate.wait()
        return self.inner.run(ops)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def stored(tmp_path):
    """A store holding 32 pages with known bytes, on a gated engine."""
    engine = GatedEngine()
    store = open_writer(store_config(tmp_path, capacity_pages=64), namespace(), engine=engine)
    src = HostMemory(32)
    expected = [src.fill(i, seed=i) for i in range(32)]
    assert all(store.put([key(i) for i in range(32)], [src.runs(i) for i in range(32)]))
    yield store, engine, expected
    store.close()


def read_into(ra: ReadAhead, keys: list[int], dst: HostMemory) -> list[bool]:
    return ra.read([key(k) for k in keys], [dst.runs(j) for j in range(len(keys))])


def test_staged_pages_are_served_from_staging_with_the_stored_bytes(stored):
    store, engine, expected = stored
    ra = ReadAhead(store.get, PAGE_BYTES, budget_bytes=16 * PAGE_BYTES, chunk_pages=4)
    assert ra.stage([key(i) for i in range(8)]) == 8
    engine.gate.set()
    for _ in range(2):  # both staged chunks' reads have started (counted) before the get's reads are counted
        assert engine.reads_started.acquire(timeout=60)
    dst = HostMemory(8)
    ops_before = engine.read_ops
    assert read_into(ra, list(range(8)), dst) == [True] * 8
    assert engine.read_ops == ops_before  # no second read from the device
    assert [dst.page(j).tobytes() for j in range(8)] == expected[:8]
    assert ra.counters.served == 8 and ra.staged_keys() == 0 and ra.buffers_in_use() == 0
    ra.close()


def test_a_get_joins_a_staged_read_still_in_flight(stored):
    store, engine, expected = stored
    ra = ReadAhead(store.get, PAGE_BYTES, budget_bytes=16 * PAGE_BYTES, chunk_pages=8)
    engine.gate.clear()
    ra.stage([key(i) for i in range(4)])
    engine.reads_started.acquire()  # the staging read has reached the device and waits there
    dst, result = HostMemory(4), {}
    taker = threading.Thread(target=lambda: result.update(oks=read_into(ra, [0, 1, 2, 3], dst)))
    taker.start()
    engine.gate.set()
    taker.join()
    assert result["oks"] == [True] * 4
    assert [dst.page(j).tobytes() for j in range(4)] == expected[:4]
    assert ra.counters.joined == 4 and ra.counters.served == 4
    ra.close()


def test_unstaged_and_missing_keys_are_read_from_the_store_in_order(stored):
    store, engine, expected = stored
    ra = ReadAhead(store.get, PAGE_BYTES, budget_bytes=16 * PAGE_BYTES)
    ra.stage([key(2), key(3)])
    dst = HostMemory(5)
    assert read_into(ra, [1, 2, 3, 999, 4], dst) == [True, True, True, False, True]
    assert dst.page(0).tobytes() == expected[1] and dst.page(4).tobytes() == expected[4]
    assert dst.page(1).tobytes() == expected[2]
    assert ra.counters.served == 2
    ra.close()


def test_the_budget_bounds_staging_and_leading_keys_go_first(stored):
    store, engine, expected = stored
    ra = ReadAhead(store.get, PAGE_BYTES, budget_bytes=5 * PAGE_BYTES + 100)
    assert ra.stage([key(i) for i in range(12)]) == 5
    assert ra.counters.skipped_full == 7 and ra.buffers_in_use() == 5
    assert ra.stage([key(20)]) == 0  # full until something is taken
    dst = HostMemory(12)
    assert read_into(ra, list(range(12)), dst) == [True] * 12  # the rest read on demand
    assert [dst.page(j).tobytes() for j in range(12)] == expected[:12]
    assert ra.counters.served == 5 and ra.buffers_in_use() == 0
    assert ra.stage([key(20), key(21)]) == 2  # the budget is free again
    ra.close()


def test_stale_entries_are_dropped_and_in_flight_ones_freed_when_their_read_ends(stored):
    store, engine, expected = stored
    now = [0.0]
    ra = ReadAhead(store.get, PAGE_BYTES, budget_bytes=4 * PAGE_BYTES, chunk_pages=2, workers=1, stale_s=10.0,
                   clock=lambda: now[0])
    ra.stage([key(0), key(1)])  # read completes: READY, never taken (a cancelled prefetch)
    ra._pool.submit(lambda: None).result()  # one worker, FIFO: the first job has finished
    engine.reads_started.acquire()
    engine.gate.clear()
    ra.stage([key(2), key(3)])
    engine.reads_started.acquire()  # ...this one is still reading
    now[0] = 11.0
    assert ra.stage([key(4), key(5)]) == 2  # sweeps 0..3: two freed now, two handed to their read
    assert ra.counters.dropped == 4 and ra.staged_keys() == 2
    assert ra.buffers_in_use() == 4  # 4, 5 and the two still under their read
    engine.gate.set()
    ra.close()  # waits for the reads; every buffer comes back
    assert ra.buffers_in_use() == 0


def test_a_failed_staged_read_is_read_again_on_demand(stored, tmp_path):
    store, engine, expected = stored
    calls = []

    def flaky(keys, pages):
        calls.append(len(keys))
        if len(calls) == 1:
            raise OSError("device went away for a moment")
        return store.get(keys, pages)

    ra = ReadAhead(flaky, PAGE_BYTES, budget_bytes=8 * PAGE_BYTES)
    ra.stage([key(0), key(1)])
    dst = HostMemory(2)
    assert read_into(ra, [0, 1], dst) == [True, True]
    assert [dst.page(j).tobytes() for j in range(2)] == expected[:2]
    assert ra.counters.failed == 2 and ra.counters.served == 0
    ra.close()


def test_corrupt_pages_are_never_served_from_staging(stored, tmp_path):
    store, engine, expected = stored
    segment, offset = slot_file(store, key(3))
    with open(segment, "r+b") as f:
        f.seek(offset + 100)
        f.write(b"\xff" * 64)
    ra = ReadAhead(store.get, PAGE_BYTES, budget_bytes=8 * PAGE_BYTES)
    ra.stage([key(i) for i in range(5)])
    dst = HostMemory(5)
    assert read_into(ra, list(range(5)), dst) == [True, True, True, False, True]
    assert dst.page(4).tobytes() == expected[4]
    assert store.counters.corrupt_pages == 1
    ra.close()


def test_closed_read_ahead_stages_nothing_and_zero_budget_is_off(stored):
    store, _, _ = stored
    off = ReadAhead(store.get, PAGE_BYTES, budget_bytes=PAGE_BYTES - 1)
    assert not off.enabled and off.stage([key(0)]) == 0
    off.close()
    ra = ReadAhead(store.get, PAGE_BYTES, budget_bytes=4 * PAGE_BYTES)
    ra.close()
    assert ra.stage([key(0)]) == 0
    dst = HostMemory(1)
    assert ra.read([key(0)], [dst.runs(0)]) == [True]  # still a correct reader
