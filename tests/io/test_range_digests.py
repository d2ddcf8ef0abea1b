"""Range digests (``IOOp.digest_ranges`` -> ``IOResult.part_digests``) and a write's ``before_write``, in
every engine (threads, io_uring) and passed through every wrapper (faults, throttle, stale slots).

The digest of a range is the xxh3-64 of those bytes of the op (its buffers back to back), whichever
buffers the range spans; a write's digests are taken before its bytes go out and handed to
``before_write``, whose bytes (outside the ranges) go out in the same IO.
"""

from __future__ import annotations

import errno
import os
import random
import threading

import pytest
import xxhash

from sgl_kvtier.config import FaultSpec, ThrottleSpec
from sgl_kvtier.io import probe as probes
from sgl_kvtier.io.buffers import ALIGN, AlignedBuffer
from sgl_kvtier.io.engine import ThreadPoolEngine
from sgl_kvtier.io.faulty import FaultyEngine
from sgl_kvtier.io.ops import (
    IOOp,
    IOResult,
    OpKind,
    digest,
    prepare_write,
    range_digests,
    read_digests,
    run_op_blocking,
)
from sgl_kvtier.io.stale import StaleSlotEngine
from sgl_kvtier.io.throttle import ThrottledEngine

BAD_FD = 999_999


def xxh(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def split(view: memoryview, cuts: list[int]) -> list[memoryview]:
    """``view`` cut into buffers at ``cuts`` (byte positions)."""
    edges = [0, *cuts, view.nbytes]
    return [view[a:b] for a, b in zip(edges, edges[1:])]


# ------------------------------------------------------------------------------------------ the helper
def test_range_digests_match_xxh3_of_each_range_across_buffer_boundaries():
    rng = random.Random(3)
    data = rng.randbytes(10_000)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, 6)))
        cuts += rng.sample(cuts, min(2, len(cuts)))  # zero-length buffers too
        buffers = split(memoryview(bytearray(data)), sorted(cuts))
        ranges = []
        for _ in range(rng.randint(1, 5)):
            start = rng.randint(0, len(data))
            ranges.append((start, rng.randint(0, len(data) - start)))
        assert range_digests(buffers, ranges) == [xxh(data[a:a + n]) for a, n in ranges]
    whole = [memoryview(bytearray(data))]
    assert range_digests(whole, [(0, len(data))]) == [digest(whole)]
    assert range_digests([], [(0, 0)]) == [xxh(b"")]


@pytest.mark.parametrize("bad", [(-1, 4), (0, 10_001), (9_999, 2), (5, -1)])
def test_a_range_outside_the_bytes_is_refused(bad):
    with pytest.raises(ValueError, match="outside"):
        range_digests([memoryview(bytearray(6_000)), memoryview(bytearray(4_000))], [bad])


# ------------------------------------------------------------------------------------------ the engines
@pytest.fixture(params=["threads", "uring"])
def engine(request):
    if request.param == "uring":
        verdict = probes.check("uring")
        if not verdict.available:
            pytest.skip(verdict.reason)
        from sgl_kvtier.io.uring import UringEngine

        eng = UringEngine(4)
    else:
        eng = ThreadPoolEngine(4)
    yield eng
    eng.close()


def _open(path, direct: bool) -> int:
    try:
        return os.open(path, os.O_CREAT | os.O_RDWR | (os.O_DIRECT if direct else 0), 0o600)
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            pytest.skip(f"O_DIRECT not supported on {path}")
        raise


@pytest.fixture(params=[False, True], ids=["buffered", "odirect"])
def fd(request, tmp_path):
    fd = _open(tmp_path / "data", request.param)
    yield fd
    os.close(fd)


PAGE = 16 * ALIGN
TAIL = ALIGN
PARTS = [(0, 3000), (3000, 5192), (8192, 4096), (12288, 4096)]  # the first two not 4 KiB aligned


class Pages:
    """``n`` pages of ``PAGE`` bytes, each followed by a ``TAIL`` that ``before_write`` fills: its first
    ``8 * len(PARTS)`` bytes the parts' digests. In memory every page is four aligned buffers, so parts
    (3000 and 8192 bytes in) fall inside buffers and part 1 spans two of them."""

    def __init__(self, n: int, seed: int = 0):
        self.n = n
        self.src = AlignedBuffer(n * (PAGE + TAIL))
        self.dst = AlignedBuffer(n * (PAGE + TAIL))
        self.src.view[:] = random.Random(seed).randbytes(self.src.nbytes)
        self.sealed: list[list[int] | None] = [None] * n
        self.threads: set[str] = set()

    def page(self, i: int) -> bytes:
        return bytes(self.src.view[i * (PAGE + TAIL):i * (PAGE + TAIL) + PAGE])

    def _buffers(self, arena: AlignedBuffer, i: int) -> list[memoryview]:
        at = i * (PAGE + TAIL)
        return split(arena.view[at:at + PAGE + TAIL], [4 * ALIGN, 6 * ALIGN, 12 * ALIGN, PAGE])

    def writes(self, fd: int, checksum: bool = False) -> list[IOOp]:
        ops = []
        for i in range(self.n):
            buffers = self._buffers(self.src, i)

            def seal(sums: list[int], i: int = i, tail: memoryview = buffers[-1]) -> None:
                self.threads.add(threading.current_thread().name)
                self.sealed[i] = list(sums)
                tail[:8 * len(sums)] = b"".join(s.to_bytes(8, "little") for s in sums)

            ops.append(IOOp(OpKind.WRITE, fd, i * (PAGE + TAIL), buffers, checksum=checksum, digest_ranges=PARTS,
                            before_write=seal))
        return ops

    def reads(self, fd: int, checksum: bool = False) -> list[IOOp]:
        return [IOOp(OpKind.READ, fd, i * (PAGE + TAIL), self._buffers(self.dst, i), checksum=checksum,
                     digest_ranges=PARTS) for i in range(self.n)]

    def expected(self, i: int) -> list[int]:
        page = self.page(i)
        return [xxh(page[a:a + n]) for a, n in PARTS]


def test_each_engine_digests_every_range_of_a_write_and_seals_it_before_the_bytes_go_out(engine, fd):
    pages = Pages(12)  # more ops than the depth of 4
    results = engine.run(pages.writes(fd, checksum=True))
    for i, res in enumerate(results):
        assert res.ok and res.part_digests == pages.expected(i) == pages.sealed[i], i
        whole = bytes(pages.src.view[i * (PAGE + TAIL):(i + 1) * (PAGE + TAIL)])
        assert res.checksum == xxh(whole), i  # the whole digest covers what before_write filled in
    for i in range(pages.n):  # the tail went out in the page's own IO, sealed
        on_disk = _read_back(fd, i)
        assert on_disk[:PAGE] == pages.page(i)
        assert [int.from_bytes(on_disk[PAGE + 8 * k:PAGE + 8 * k + 8], "little") for k in range(4)] == pages.expected(i)
    reads = pages.reads(fd, checksum=True)
    for i, res in enumerate(engine.run(reads)):
        assert res.ok and res.part_digests == pages.expected(i), i
        assert res.checksum == digest(reads[i].buffers)
    assert bytes(pages.dst.view) == bytes(pages.src.view)


def _read_back(fd: int, i: int) -> bytes:
    buf = AlignedBuffer(PAGE + TAIL)  # O_DIRECT wants aligned memory
    try:
        n = os.preadv(fd, [buf.view], i * (PAGE + TAIL))
        assert n == PAGE + TAIL
        return bytes(buf.view)
    finally:
        buf.close()


def test_a_bad_byte_in_part_k_changes_exactly_that_digest(engine, tmp_path):
    fd = _open(tmp_path / "data", False)
    try:
        pages = Pages(1, seed=5)
        assert engine.run(pages.writes(fd))[0].ok
        for k, (start, length) in enumerate(PARTS):
            at = start + length // 2
            byte = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([byte[0] ^ 0x01]), at)
            (res,) = engine.run(pages.reads(fd))
            os.pwrite(fd, byte, at)
            want = pages.expected(0)
            assert res.ok and res.part_digests is not None
            assert [a != b for a, b in zip(res.part_digests, want)] == [j == k for j in range(len(PARTS))], k
    finally:
        os.close(fd)


def test_ops_without_ranges_carry_none_and_failed_or_short_ops_carry_none(engine, tmp_path):
    fd = _open(tmp_path / "data", False)
    try:
        pages = Pages(2)
        assert all(r.ok for r in engine.run(pages.writes(fd)))
        plain = IOOp(OpKind.READ, fd, 0, [memoryview(bytearray(100))])
        bad = IOOp(OpKind.READ, BAD_FD, 0, [memoryview(bytearray(100))], digest_ranges=[(0, 100)])
        past = IOOp(OpKind.READ, fd, 2 * (PAGE + TAIL) - 50, [memoryview(bytearray(100))], digest_ranges=[(0, 10)])
        empty = IOOp(OpKind.READ, fd, 0, [], digest_ranges=[(0, 0)])
        res = engine.run([plain, bad, past, empty])
        assert res[0].ok and res[0].part_digests is None and res[0].checksum is not None
        assert not res[1].ok and res[1].part_digests is None
        assert res[2].short and res[2].part_digests is None
        assert res[3].ok and res[3].part_digests == [xxh(b"")]
        calls: list[list[int]] = []
        w = IOOp(OpKind.WRITE, fd, 0, [memoryview(bytearray(64))], checksum=False, before_write=calls.append)
        (wr,) = engine.run([w])
        assert wr.ok and wr.part_digests is None and calls == [[]]  # a hook without ranges gets no digests
    finally:
        os.close(fd)


def test_the_thread_engine_digests_on_its_pool_threads(tmp_path):
    fd = _open(tmp_path / "data", False)
    eng = ThreadPoolEngine(4)
    try:
        pages = Pages(8)
        assert all(r.ok for r in eng.run(pages.writes(fd)))
        assert pages.threads and all(name.startswith("kvtier-io") for name in pages.threads)
    finally:
        eng.close()
        os.close(fd)


def test_an_exception_in_before_write_is_raised_once_every_op_ended(engine, tmp_path):
    fd = _open(tmp_path / "data", False)
    try:
        pages = Pages(8)
        ops = pages.writes(fd)

        def boom(sums: list[int]) -> None:
            raise RuntimeError("a bug in before_write")

        ops[2].before_write = boom
        seal_1, moving = ops[1].before_write, []
        assert seal_1 is not None

        def counted(sums: list[int]) -> None:  # op 1 is sealed while its batch is handed to the engine
            moving.append(engine.in_flight)
            seal_1(sums)

        ops[1].before_write = counted
        with pytest.raises(RuntimeError, match="a bug"):
            engine.run(ops)
        # No op of the batch is still moving bytes: the engine owes no IO (it counted op 1's own, or op 0's
        # prepared before it on the ring), every op that was sealed is on disk whole, the others never went
        # out, and the engine is usable.
        assert moving and moving[0] >= 1 and engine.in_flight == 0
        assert pages.sealed[2] is None
        size = os.fstat(fd).st_size
        for i in range(pages.n):
            at = i * (PAGE + TAIL)
            on_disk = os.pread(fd, PAGE, at)
            if pages.sealed[i] is not None:
                assert on_disk == pages.page(i), i
            else:
                assert on_disk == bytes(min(PAGE, max(0, size - at))), i  # a hole, or past the end
        pages2 = Pages(2, seed=9)
        assert all(r.ok for r in engine.run(pages2.writes(fd)))
    finally:
        os.close(fd)


def test_run_op_blocking_seals_a_write_and_digests_a_read(tmp_path):
    fd = _open(tmp_path / "data", False)
    try:
        pages = Pages(1)
        (op,) = pages.writes(fd)
        res = run_op_blocking(op)
        assert res.ok and res.part_digests == pages.expected(0) == pages.sealed[0]
        (read,) = pages.reads(fd)
        assert run_op_blocking(read).part_digests == pages.expected(0)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ the wrappers
class NullEngine:
    """Moves no bytes; seals writes and digests reads as a real engine does; remembers the ops it got."""

    name = "null"

    def __init__(self) -> None:
        self.ops: list[IOOp] = []

    def run(self, ops):
        out = []
        for op in ops:
            self.ops.append(op)
            if op.kind is OpKind.WRITE:
                crc, parts = None, prepare_write(op)
            else:
                crc, parts = read_digests(op)
            out.append(IOResult(sum(b.nbytes for b in op.buffers), crc, part_digests=parts))
        return out

    def close(self) -> None:
        pass


def test_a_torn_write_is_sealed_whole_and_reports_the_whole_pages_digests():
    pages = Pages(3)
    inner = NullEngine()
    eng = FaultyEngine(inner, FaultSpec(torn_write_rate=1.0))
    results = eng.run(pages.writes(-1, checksum=True))
    for i, res in enumerate(results):
        assert res.ok and res.nbytes == PAGE + TAIL and res.part_digests == pages.expected(i) == pages.sealed[i]
    sent = inner.ops
    assert all(op.digest_ranges is None and op.before_write is None for op in sent)  # the half that went out
    assert all(sum(b.nbytes for b in op.buffers) == (PAGE + TAIL) // 2 // ALIGN * ALIGN for op in sent)


def test_faults_pass_digests_through_and_a_failed_write_is_never_sealed():
    pages = Pages(4)
    eng = FaultyEngine(NullEngine(), FaultSpec(stall_rate=1.0, stall_s=0.0))
    assert [r.part_digests for r in eng.run(pages.writes(-1))] == [pages.expected(i) for i in range(4)]
    pages = Pages(4)
    failed = FaultyEngine(NullEngine(), FaultSpec(write_error_rate=1.0)).run(pages.writes(-1))
    assert all(not r.ok and r.part_digests is None for r in failed) and pages.sealed == [None] * 4


def test_the_throttle_passes_digests_through():
    pages = Pages(2)
    eng = ThrottledEngine(NullEngine(), ThrottleSpec(read_bytes_per_s=1e12, write_bytes_per_s=1e12),
                          sleep=lambda s: None)
    assert [r.part_digests for r in eng.run(pages.writes(-1))] == [pages.expected(i) for i in range(2)]


def test_a_stale_slot_read_digests_the_bytes_it_served(tmp_path):
    path = tmp_path / "data"
    fd = _open(path, False)
    eng = StaleSlotEngine(ThreadPoolEngine(2))
    try:
        pages = Pages(1, seed=1)
        assert eng.run(pages.writes(fd))[0].ok
        old = bytes(reversed(pages.page(0))) + bytes(TAIL)
        eng.remember(path, 0, old)
        (res,) = eng.run(pages.reads(fd))
        assert eng.served == 1 and res.ok
        assert res.part_digests == [xxh(old[a:a + n]) for a, n in PARTS]
    finally:
        eng.close()
        os.close(fd)
