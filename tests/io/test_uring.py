"""UringEngine: byte-exact vectored IO, checksums, EOF, errors, threads, and parity with ThreadPoolEngine.

Nothing here touches liburing in this process before the ``uring`` probe (a child process) said it runs
on this machine: tests that need io_uring take the ``uring_ok`` fixture, which skips with the probe's
reason otherwise; the rest (pure Python) always run.
"""

from __future__ import annotations

import errno
import os
import random
import threading

import pytest

from sgl_kvtier.io import probe as probes
from sgl_kvtier.io import uring as uring_mod
from sgl_kvtier.io.buffers import ALIGN, AlignedBuffer
from sgl_kvtier.io.engine import ThreadPoolEngine
from sgl_kvtier.io.ops import IOOp, IOResult, OpKind, digest
from sgl_kvtier.io.probe import ProbeStatus
from sgl_kvtier.io.uring import UringEngine, _setup_failure, _Xfer

BAD_FD = 999_999  # never an open descriptor here: the tests open a handful of files


@pytest.fixture(scope="module")
def uring_ok() -> None:
    """Skip, with the probe's reason, unless the child-process probe says io_uring runs here."""
    verdict = probes.check("uring")
    if not verdict.available:
        pytest.skip(verdict.reason)


@pytest.fixture
def engine(uring_ok):
    eng = UringEngine(8)
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


class Layout:
    """``n`` ops of 1-4 buffers (whole 4 KiB blocks each), back to back in the file; in memory every
    buffer sits at a shuffled spot of an aligned arena, so an op's buffers are scattered."""

    def __init__(self, n: int, seed: int = 0, max_blocks: int = 6):
        rng = random.Random(seed)
        self.pieces = [
            [rng.randint(1, max_blocks) * ALIGN for _ in range(rng.randint(1, 4))] for _ in range(n)
        ]
        flat = [(i, j, size) for i, sizes in enumerate(self.pieces) for j, size in enumerate(sizes)]
        rng.shuffle(flat)
        self.slices: list[list] = [[None] * len(sizes) for sizes in self.pieces]
        pos = 0
        for i, j, size in flat:
            self.slices[i][j] = (pos, size)
            pos += size
        self.src, self.dst = AlignedBuffer(pos), AlignedBuffer(pos)
        self.src.view[:] = rng.randbytes(self.src.nbytes)
        self.offsets, off = [], 0
        for sizes in self.pieces:
            self.offsets.append(off)
            off += sum(sizes)
        self.file_size = off

    def ops(self, kind: OpKind, fd: int, checksum: bool = True) -> list[IOOp]:
        arena = self.src if kind is OpKind.WRITE else self.dst
        return [
            IOOp(kind, fd, off, [arena.view[p : p + size] for p, size in slots], checksum)
            for off, slots in zip(self.offsets, self.slices)
        ]

    def expected(self, i: int) -> bytes:
        return b"".join(bytes(self.src.view[p : p + size]) for p, size in self.slices[i])


def _key(r: IOResult):
    return (r.nbytes, r.checksum, r.short, type(r.error), getattr(r.error, "errno", None))


def test_round_trip_is_byte_exact_with_checksums(engine, fd):
    lay = Layout(60)  # more ops than the depth of 8: the queue is refilled as completions come back
    writes = lay.ops(OpKind.WRITE, fd)
    wres = engine.run(writes)
    assert [r.nbytes for r in wres] == [sum(s) for s in lay.pieces]
    assert all(r.ok and not r.short for r in wres)
    assert [r.checksum for r in wres] == [digest(op.buffers) for op in writes]

    reads = lay.ops(OpKind.READ, fd)
    rres = engine.run(reads)
    assert all(r.ok and not r.short for r in rres)
    for i, (op, r) in enumerate(zip(reads, rres)):
        got = b"".join(bytes(b) for b in op.buffers)
        assert got == lay.expected(i), f"op {i} differs"
        assert r.checksum == digest(op.buffers) == wres[i].checksum

    with open(f"/proc/self/fd/{fd}", "rb") as f:  # the file itself holds the ops back to back
        assert f.read() == b"".join(lay.expected(i) for i in range(len(lay.pieces)))


def test_checksum_off_and_empty_batch(engine, fd):
    lay = Layout(5, seed=3)
    assert engine.run([]) == []
    for r in engine.run(lay.ops(OpKind.WRITE, fd, checksum=False)):
        assert r.ok and r.checksum is None
    for r in engine.run(lay.ops(OpKind.READ, fd, checksum=False)):
        assert r.ok and r.checksum is None


@pytest.mark.parametrize("depth", [1, 2, 32])
def test_any_depth(uring_ok, tmp_path, depth):
    fd = _open(tmp_path / "d", True)
    eng = UringEngine(depth)
    try:
        lay = Layout(20, seed=depth)
        assert all(r.ok for r in eng.run(lay.ops(OpKind.WRITE, fd)))
        assert all(r.ok for r in eng.run(lay.ops(OpKind.READ, fd)))
        assert bytes(lay.dst.view) == bytes(lay.src.view)
    finally:
        eng.close()
        os.close(fd)


def test_read_past_eof_is_short(engine, tmp_path):
    fd = _open(tmp_path / "eof", False)
    data = os.urandom(10_000)
    os.pwrite(fd, data, 0)
    buf = AlignedBuffer(4 * ALIGN)
    v = buf.view
    ops = [
        IOOp(OpKind.READ, fd, 0, [v[:4096], v[4096:8192], v[8192:12288]]),  # ends mid-third buffer
        IOOp(OpKind.READ, fd, 12_288, [v[12288:]]),  # wholly past EOF
    ]
    crossing, beyond = engine.run(ops)
    assert crossing.short and crossing.nbytes == 10_000 and crossing.checksum is None
    assert isinstance(crossing.error, OSError) and crossing.error.errno == errno.EIO
    assert bytes(v[:10_000]) == data  # what there was arrived in place, across buffers
    assert beyond.short and beyond.nbytes == 0 and beyond.error.errno == errno.EIO
    os.close(fd)


def test_bad_fd_fails_alone(engine, fd):
    lay = Layout(6, seed=5)
    assert all(r.ok for r in engine.run(lay.ops(OpKind.WRITE, fd)))
    reads = lay.ops(OpKind.READ, fd)
    reads[2].fd = BAD_FD
    reads[4].fd = -1
    res = engine.run(reads)
    for i in (2, 4):
        assert not res[i].ok and res[i].error.errno == errno.EBADF and res[i].checksum is None
    for i in (0, 1, 3, 5):
        assert res[i].ok and b"".join(bytes(b) for b in reads[i].buffers) == lay.expected(i)
    # writing through a read-only fd is an error result too, not an exception
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    try:
        (r,) = engine.run([IOOp(OpKind.WRITE, ro, 0, [lay.src.view[:ALIGN]])])
        assert r.error is not None and r.error.errno == errno.EBADF
    finally:
        os.close(ro)


def test_three_threads_at_once(engine, fd):
    lays = [Layout(24, seed=10 + t) for t in range(3)]
    base = [0, lays[0].file_size, lays[0].file_size + lays[1].file_size]
    barrier = threading.Barrier(3)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            lay = lays[t]
            for rnd in range(4):
                writes = lay.ops(OpKind.WRITE, fd)
                for op in writes:
                    op.offset += base[t]
                barrier.wait()
                assert all(r.ok for r in engine.run(writes))
                reads = lay.ops(OpKind.READ, fd)
                for op in reads:
                    op.offset += base[t]
                lay.dst.view[:] = b"\0" * lay.dst.nbytes
                barrier.wait()
                res = engine.run(reads)
                for i, (op, r) in enumerate(zip(reads, res)):
                    assert r.ok and r.checksum == digest(op.buffers), (t, rnd, i)
                    assert b"".join(bytes(b) for b in op.buffers) == lay.expected(i), (t, rnd, i)
        except BaseException as exc:  # reported below; abort the barrier so the others do not hang
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_same_results_as_thread_engine(engine, tmp_path):
    fd = _open(tmp_path / "cmp", True)
    lay = Layout(30, seed=7)
    threads = ThreadPoolEngine(8)
    try:
        w_uring = engine.run(lay.ops(OpKind.WRITE, fd))
        w_threads = threads.run(lay.ops(OpKind.WRITE, fd))
        assert list(map(_key, w_uring)) == list(map(_key, w_threads))

        def batch():
            ops = lay.ops(OpKind.READ, fd)
            ops[3].fd = BAD_FD
            ops[5].offset = lay.file_size  # past EOF
            ops[7].buffers = []  # nothing to move
            ops[9].checksum = False
            return ops

        r_uring = engine.run(batch())
        got_uring = bytes(lay.dst.view)
        lay.dst.view[:] = b"\0" * lay.dst.nbytes
        r_threads = threads.run(batch())
        assert list(map(_key, r_uring)) == list(map(_key, r_threads))
        assert got_uring == bytes(lay.dst.view)
    finally:
        threads.close()
        os.close(fd)


def test_partial_completion_resumes_inside_a_buffer():
    a, b = bytearray(8192), bytearray(4096)
    op = IOOp(OpKind.READ, 0, 100, [memoryview(a), memoryview(b)])
    x = _Xfer(op, 12288, None)
    assert x.complete(5000) is None  # short: resubmit the rest
    assert (x.offset, x.done, [m.nbytes for m in x.bufs]) == (5100, 5000, [3192, 4096])
    assert x.complete(-errno.EAGAIN) is None  # retried as is
    assert x.complete(3192) is None and [m.nbytes for m in x.bufs] == [4096]
    done = x.complete(4096)
    assert done is not None and done.ok and done.nbytes == 12288
    assert done.checksum is None  # a read's checksum is taken by the batch loop, after refilling
    assert _Xfer(op, 12288, None).complete(-errno.EIO).error.errno == errno.EIO


def test_close(uring_ok):
    eng = UringEngine(4)
    eng.close()
    eng.close()
    with pytest.raises(RuntimeError):
        eng.run([IOOp(OpKind.READ, 0, 0, [memoryview(bytearray(1))])])


def test_no_ring_to_spare_falls_back_to_blocking_io(uring_ok, monkeypatch, tmp_path):
    fd = _open(tmp_path / "fb", False)
    eng = UringEngine(4)
    try:
        def no_ring(depth):
            raise OSError(errno.ENOMEM, "no memory for another ring")

        monkeypatch.setattr(uring_mod, "_Ring", no_ring)
        eng._idle.pop().close()  # as if the one ring were busy: run() must make another, and cannot
        lay = Layout(4, seed=9)
        assert all(r.ok for r in eng.run(lay.ops(OpKind.WRITE, fd)))
        assert all(r.ok for r in eng.run(lay.ops(OpKind.READ, fd)))
        assert bytes(lay.dst.view) == bytes(lay.src.view)
    finally:
        eng.close()
        os.close(fd)


@pytest.mark.parametrize("code, proc, status, words", [
    (errno.EPERM, {"/proc/sys/kernel/io_uring_disabled": "2"}, ProbeStatus.DENIED,
     "EPERM: the sysctl kernel.io_uring_disabled = 2 forbids it"),
    (errno.EPERM, {"/proc/sys/kernel/io_uring_disabled": "0", "Seccomp:": "2"}, ProbeStatus.DENIED,
     "EPERM: a seccomp filter"),
    (errno.EACCES, {}, ProbeStatus.DENIED, "EACCES: the kernel refused io_uring_setup"),
    (errno.ENOSYS, {}, ProbeStatus.DENIED, "ENOSYS: io_uring_setup is missing"),
    (errno.ENOMEM, {"Max locked memory": "65536 65536 bytes"}, ProbeStatus.MEMLOCK,
     "ENOMEM: no locked memory for a ring (RLIMIT_MEMLOCK: 65536 65536 bytes)"),
    (errno.EINVAL, {}, ProbeStatus.FAILED, "io_uring_setup failed: [Errno 22]"),
])  # fmt: skip
def test_ring_setup_failures_get_specific_reasons(monkeypatch, code, proc, status, words):
    """What the probe's child reports when io_uring_setup fails (pure Python: runs everywhere)."""
    monkeypatch.setattr(probes, "proc_text", lambda path, field=None: proc.get(field or path, ""))
    got_status, reason = _setup_failure(OSError(code, os.strerror(code)))
    assert got_status is status and reason.startswith(words)

