"""``ThreadPoolEngine``: a batch handed to its workers at once (no future per op), results in op order,
at most ``depth`` workers, one op on the caller's thread, a partial transfer finished, close and reuse;
``buffers.view``: a slice of the address space that aliases the caller's memory.

No test sleeps to synchronise: an op held in flight waits on a ``threading.Event`` its test sets.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import xxhash
from thread_kit import BOUND_S, finished, start

from sgl_kvtier.io import ops
from sgl_kvtier.io.buffers import AlignedBuffer, view
from sgl_kvtier.io.engine import IOOp, OpKind, ThreadPoolEngine

PAGE = 4096


@pytest.fixture
def data_file(tmp_path: Path):
    """An fd on 64 pages of known bytes (page ``i`` is ``i`` repeated), closed after the test."""
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"".join(bytes([i]) * PAGE for i in range(64)))
    yield fd
    os.close(fd)


def reads(fd: int, buf: AlignedBuffer, pages: range) -> list[IOOp]:
    """One checksummed read per page, page ``i`` into ``buf``'s page ``i``, in two buffers each."""
    return [IOOp(OpKind.READ, fd, i * PAGE, [buf.view[i * PAGE:i * PAGE + 1000],
                                             buf.view[i * PAGE + 1000:(i + 1) * PAGE]], checksum=True) for i in pages]


def io_workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvtier-io_")}


def test_a_batch_lands_every_op_in_order_on_at_most_depth_workers(data_file) -> None:
    buf = AlignedBuffer(64 * PAGE)
    before = io_workers()  # other engines' (a test run shares the process)
    engine = ThreadPoolEngine(3)
    try:
        for _ in range(3):  # the same workers serve batch after batch
            results = engine.run(reads(data_file, buf, range(64)))
            assert [r.nbytes for r in results] == [PAGE] * 64 and all(r.ok for r in results)
            assert [r.checksum for r in results] == [xxhash.xxh3_64_intdigest(bytes([i]) * PAGE) for i in range(64)]
            assert bytes(buf.view[:64 * PAGE]) == b"".join(bytes([i]) * PAGE for i in range(64))
            assert engine.in_flight == 0
        workers = io_workers() - before
        assert 1 <= len(workers) <= 3 and all(t.daemon for t in workers)
    finally:
        engine.close()
        buf.close()
    assert not any(t.is_alive() for t in workers)  # close stopped them


def test_one_op_runs_on_the_calling_thread_and_an_empty_batch_is_nothing(data_file) -> None:
    buf = AlignedBuffer(PAGE)
    before = io_workers()
    engine = ThreadPoolEngine(4)
    seen: list[int] = []
    op = IOOp(OpKind.WRITE, data_file, 0, [buf.view[:PAGE]], before_write=lambda _: seen.append(threading.get_ident()))
    try:
        assert engine.run([]) == []
        assert engine.run([op])[0].ok and seen == [threading.get_ident()]
        assert io_workers() <= before  # none started
    finally:
        engine.close()
        buf.close()


def test_close_waits_for_the_batch_in_flight_then_refuses_runs(data_file) -> None:
    buf = AlignedBuffer(8 * PAGE)
    engine = ThreadPoolEngine(2)
    entered, release = threading.Event(), threading.Event()

    def hold(_sums: list[int]) -> None:
        entered.set()
        assert release.wait(BOUND_S)

    writes = [IOOp(OpKind.WRITE, data_file, i * PAGE, [buf.view[i * PAGE:(i + 1) * PAGE]]) for i in range(8)]
    writes[5].before_write = hold
    runner, out = start(engine.run, writes)
    assert entered.wait(BOUND_S)
    closer, _ = start(engine.close)
    closer.join(0.2)
    assert closer.is_alive() and runner.is_alive() and engine.in_flight >= 1  # close waits for op 5
    release.set()
    assert finished(runner) and finished(closer)
    assert len(out[0]) == 8 and all(r.ok for r in out[0]) and engine.in_flight == 0
    with pytest.raises(RuntimeError, match="closed"):
        engine.run(writes[:2])
    engine.close()  # idempotent
    buf.close()


def test_a_partial_transfer_is_finished_and_eof_stops_it(data_file, monkeypatch) -> None:
    """``os.preadv`` moving 1,500 bytes a call: the op still lands whole, its checksum over every byte; a
    read past the end of the file stops at EOF, short."""
    real = os.preadv

    def dribble(fd: int, buffers: list[memoryview], offset: int) -> int:
        first = buffers[0][:1500]
        return real(fd, [first], offset)

    monkeypatch.setattr(ops.os, "preadv", dribble)
    buf = AlignedBuffer(4 * PAGE)
    try:
        res = ops.run_op_blocking(reads(data_file, buf, range(3, 4))[0])
        assert res.ok and res.nbytes == PAGE and bytes(buf.view[3 * PAGE:4 * PAGE]) == bytes([3]) * PAGE
        assert res.checksum == xxhash.xxh3_64_intdigest(bytes([3]) * PAGE)
        short = ops.run_op_blocking(IOOp(OpKind.READ, data_file, 63 * PAGE + 100, [buf.view[:PAGE]]))
        assert short.short and short.nbytes == PAGE - 100
    finally:
        buf.close()


def test_view_aliases_the_callers_memory_and_refuses_no_address() -> None:
    buf = AlignedBuffer(PAGE)
    try:
        v = view(buf.address + 100, 50)
        assert v.nbytes == 50 and not v.readonly and v.format == "B"
        v[:] = b"x" * 50
        assert bytes(buf.view[100:150]) == b"x" * 50 and bytes(buf.view[99:100]) == b"\0"
        buf.view[120] = ord("y")
        assert v[20] == ord("y")
    finally:
        buf.close()
    for address, length in ((0, 10), (-4096, 10), (4096, -1)):
        with pytest.raises(ValueError, match="no memory"):
            view(address, length)
