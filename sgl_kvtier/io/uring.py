"""``UringEngine``: batches of vectored reads/writes through io_uring (the PyPI ``liburing`` package).

Besides the engine contract (``ops.py``): a negative completion is ``OSError(-res)`` (EINTR/EAGAIN retried),
a 0-byte transfer before the end is ``short`` EIO, a partial one is resubmitted for the rest. Write digests
are taken before submission, read digests after the last completion once the queue is refilled, both on the
calling thread. At most ``depth`` ops are in flight per ring; every ``Iovec`` and buffer given to the kernel
stays referenced until its completion is reaped, and ``run`` waits for every completion before returning,
also on an exception (``in_flight`` keeps counting ops a failed drain left). Completions are reaped one at
a time (the binding's ``cqe[i]`` ignores ring wrap-around), and waits are ``poll()`` on the ring fd, since
``io_uring_wait_cqe`` holds the GIL.

``liburing`` is imported only after ``probe.require("uring")`` passed in a child process (its wheel may use
instructions this CPU lacks, or the kernel may refuse io_uring). Each ``run`` checks a ring out of a pool
(made when all are busy): a ring serves one thread at a time, a small prefetch never waits behind a
write-back batch, and ``close()`` reaches every ring.
"""

from __future__ import annotations

import errno
import os
import select
import tempfile
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from sgl_kvtier.io import probe as probes
from sgl_kvtier.io.ops import (
    IOOp,
    IOResult,
    OpKind,
    digest,
    op_length,
    prepare_write,
    read_digests,
    run_op_blocking,
    short_error,
)

_RETRY = (errno.EINTR, errno.EAGAIN)
_MAX_TRIES = 16
_NEEDED_OPS = ("IORING_OP_NOP", "IORING_OP_READV", "IORING_OP_WRITEV")
_lu: Any = None  # the liburing module, imported by _liburing() once a probe said it runs here


def _liburing() -> Any:
    """Import ``liburing`` (only ever after its probe, or inside the probe's child)."""
    global _lu
    if _lu is None:
        import liburing

        _lu = liburing
    return _lu


class _Ring:
    """One io_uring instance, waited on without holding the GIL."""

    def __init__(self, depth: int):
        self.ring: Any = _lu.Ring()
        _lu.io_uring_queue_init(depth, self.ring)  # an SQE failing at submit stops it: see submit()
        self.cqe: Any = _lu.Cqe()
        self.dirty = False  # completions may still be owed: never reuse it, never free it
        self.poller = select.poll()
        self.poller.register(self.ring.ring_fd, select.POLLIN)

    def wait(self, timeout_ms: int = -1) -> bool:
        """Block, GIL released, until a completion is ready; False on timeout."""
        while not _lu.io_uring_cq_ready(self.ring):
            if not self.poller.poll(timeout_ms) and timeout_ms >= 0:
                return bool(_lu.io_uring_cq_ready(self.ring))
        return True

    def reap_one(self) -> tuple[int, int]:
        """Pop one ready completion: ``(user_data, res)``, ``res`` negative for an errno."""
        _lu.io_uring_peek_cqe(self.ring, self.cqe)
        entry = self.cqe[0]
        user_data = int(entry.user_data)
        try:
            res = int(entry.res)  # the binding raises OSError for a negative res
        except OSError as exc:
            res = -(exc.errno or errno.EIO)
        _lu.io_uring_cqe_seen(self.ring, entry)
        return user_data, res

    def submit(self) -> None:
        """Hand every prepared SQE to the kernel. Submission stops after an SQE that fails at submit (a
        bad fd; its error comes back as a CQE), and on a transient shortage: submit the rest again."""
        for _ in range(_MAX_TRIES):
            try:
                _lu.io_uring_submit(self.ring)
            except OSError as exc:
                if exc.errno not in _RETRY + (errno.EBUSY,):
                    raise
            if not _lu.io_uring_sq_ready(self.ring):
                return
        raise OSError(errno.EAGAIN, "io_uring: the kernel keeps refusing submissions")

    def close(self) -> None:
        """Tear the ring down (only when no completion is owed)."""
        _lu.io_uring_queue_exit(self.ring)


class _Xfer:
    """One op in flight: what is left to move, and what the kernel may touch (kept alive here)."""

    __slots__ = ("op", "bufs", "offset", "done", "want", "crc", "parts", "iov", "tries")

    def __init__(self, op: IOOp, want: int, crc: int | None, parts: list[int] | None = None):
        self.op, self.bufs, self.offset = op, list(op.buffers), op.offset
        self.done, self.want, self.crc, self.parts, self.tries = 0, want, crc, parts, 0
        self.iov: Any = None

    def prep(self, ring: _Ring, user_data: int) -> None:
        """Prepare this op's (next) SQE on ``ring``, tagged ``user_data``."""
        if self.iov is None:  # built before taking an SQE, so a failure cannot leave one half-made
            self.iov = _lu.Iovec(self.bufs)
        sqe = _lu.io_uring_get_sqe(ring.ring)
        if sqe is None:  # cannot happen: prepared + in flight <= depth <= SQ entries
            raise RuntimeError("io_uring submission queue full")
        prep = _lu.io_uring_prep_readv if self.op.kind is OpKind.READ else _lu.io_uring_prep_writev
        prep(sqe, self.op.fd, self.iov, self.offset)
        _lu.io_uring_sqe_set_data64(sqe, user_data)

    def complete(self, res: int) -> IOResult | None:
        """Account one completion: the op's result when it is finished, None to resubmit the rest.
        A read's checksum is left to the caller, who takes it after refilling the queue."""
        self.iov = None  # the kernel is done with the iovec; the buffers stay referenced by self/op
        if res < 0:
            if -res in _RETRY and self.tries < _MAX_TRIES:
                self.tries += 1
                return None
            return IOResult(0, None, OSError(-res, os.strerror(-res)))
        if res == 0:  # EOF, or a device that moved nothing: a truncated or torn slot
            return IOResult(self.done, None, short_error(self.op, self.done), short=True)
        self.done, self.offset, n = self.done + res, self.offset + res, res
        while self.bufs and n >= self.bufs[0].nbytes:  # drop what moved; resume inside a buffer
            n -= self.bufs.pop(0).nbytes
        if n:
            self.bufs[0] = self.bufs[0][n:]
        if self.done < self.want:
            return None
        return IOResult(self.done, self.crc, part_digests=self.parts)


def _start(op: IOOp) -> _Xfer | IOResult:
    """An ``_Xfer`` ready to prep, or the op's result when it is settled without IO."""
    want = op_length(op)
    if not (0 <= op.fd < 2**31 and 0 <= op.offset < 2**63):
        bad = errno.EINVAL if 0 <= op.fd < 2**31 else errno.EBADF
        return IOResult(0, None, OSError(bad, os.strerror(bad)))
    crc: int | None = None
    parts: list[int] | None = None
    if op.kind is OpKind.WRITE:
        parts = prepare_write(op) if op.digest_ranges is not None or op.before_write is not None else None
        crc = digest(op.buffers) if op.checksum else None  # after ``before_write`` filled its bytes
    elif want == 0:
        crc, parts = read_digests(op)
    if want == 0:
        return IOResult(0, crc, part_digests=parts)
    x = _Xfer(op, want, crc, parts)
    try:
        x.iov = _lu.Iovec(x.bufs)
    except (TypeError, ValueError) as exc:  # not buffers, or more than IOV_MAX of them
        return IOResult(0, None, OSError(errno.EINVAL, f"{os.strerror(errno.EINVAL)}: {exc}"))
    return x


class UringEngine:
    """io_uring, ``depth`` ops in flight per concurrent caller; moves caller memory in place."""

    name = "uring"

    def __init__(self, depth: int):
        """Raises ``probe.ProbeUnavailableError`` (with the probe's reason) where io_uring cannot run, and
        ``OSError`` when the first ring cannot be made."""
        probes.require("uring")
        self._setup(depth)

    @classmethod
    def _unprobed(cls, depth: int) -> UringEngine:
        """For the probe's child only: the engine under test cannot wait for its own verdict."""
        engine = cls.__new__(cls)
        engine._setup(depth)
        return engine

    def _setup(self, depth: int) -> None:
        _liburing()
        self.depth = max(1, int(depth))
        self._lock = threading.Lock()
        self._closed = False
        self._idle: list[_Ring] = [_Ring(self.depth)]  # fail here, not in run(), if rings cannot be made
        self._tables: dict[int, dict[int, _Xfer]] = {}  # id -> the in-flight table of a run in progress

    @property
    def in_flight(self) -> int:
        """Ops prepared on a ring whose completion is not reaped yet (see the module docstring)."""
        with self._lock:
            tables = list(self._tables.values())
        return sum(len(t) for t in tables)

    @classmethod
    def probe(cls) -> bool:
        """True when io_uring works here (``probe.check("uring")``: a child process, cached). Never raises."""
        return probes.check("uring").available

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        """Execute all ops, ``depth`` in flight; results in the order of ``ops``."""
        if not ops:
            return []
        with self._lock:
            if self._closed:
                raise RuntimeError("UringEngine is closed")
            ring = self._idle.pop() if self._idle else None
        try:
            ring = ring or _Ring(self.depth)
        except OSError:  # no further ring here now (memlock, ENOMEM): the same results, one op at a time
            return [run_op_blocking(op) for op in ops]
        try:
            return self._run(ring, ops)
        finally:
            with self._lock:
                keep = not ring.dirty and not self._closed
                if keep:
                    self._idle.append(ring)
            if not keep and not ring.dirty:
                ring.close()  # a dirty ring is dropped without exit: the kernel may still own buffers

    def close(self) -> None:
        """Free the idle rings now; a ring busy in ``run`` is freed when that ``run`` returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for ring in idle:
            ring.close()

    def _run(self, ring: _Ring, ops: Sequence[IOOp]) -> list[IOResult]:
        results: list[IOResult | None] = [None] * len(ops)
        todo = deque(range(len(ops)))
        inflight: dict[int, _Xfer] = {}  # user_data (= op index) -> transfer; holds buffers and iovecs
        with self._lock:
            self._tables[id(inflight)] = inflight
        prepped = 0  # SQEs prepared, not yet submitted; all of them are also in ``inflight``
        unhashed: list[tuple[IOOp, IOResult]] = []  # reads moved in full whose checksum is still to be taken
        try:
            while True:
                while todo and len(inflight) < self.depth:
                    i = todo.popleft()
                    x = _start(ops[i])
                    if isinstance(x, IOResult):
                        results[i] = x
                        continue
                    x.prep(ring, i)
                    inflight[i] = x
                    prepped += 1
                if prepped:
                    ring.submit()
                    prepped = 0
                for op, done in unhashed:  # hash once the device has work again, not while it idles
                    done.checksum, done.part_digests = read_digests(op)
                unhashed.clear()
                if not inflight:  # the fill above leaves nothing to do only at the end
                    break
                ring.wait()
                while _lu.io_uring_cq_ready(ring.ring):  # one CQE at a time, never several by index
                    i, res = ring.reap_one()
                    result = inflight[i].complete(res)
                    if result is None:  # the rest of a partial transfer, or a retry: same slot
                        inflight[i].prep(ring, i)
                        prepped += 1
                    else:
                        op = inflight.pop(i).op
                        results[i] = result
                        if result.ok and op.kind is OpKind.READ and (op.checksum or op.digest_ranges is not None):
                            unhashed.append((op, result))
        finally:
            if inflight:
                _drain(ring, inflight)
            if not inflight:  # else the kernel may still move those ops' bytes: they stay counted
                with self._lock:
                    self._tables.pop(id(inflight), None)
        settled = [r for r in results if r is not None]
        assert len(settled) == len(ops), "every op is settled before the loop ends"
        return settled


def _drain(ring: _Ring, inflight: dict[int, _Xfer]) -> None:
    """After an exception mid-batch: wait until the kernel is done with every buffer still in flight."""
    ring.dirty = True
    try:
        _lu.io_uring_submit(ring.ring)  # flush SQEs prepared but not yet submitted
        while inflight and ring.wait(60_000):
            inflight.pop(ring.reap_one()[0], None)
    except BaseException:
        return
    ring.dirty = bool(inflight)


def self_test() -> None:
    """The ``uring`` probe's target; runs only in the probe's child process (see ``probe.py``).

    Imports ``liburing``, sets up a ring, round-trips a no-op, then writes and reads back a small file
    through a ``UringEngine`` (vectored, checksummed). Raises ``ProbeFailure`` with a specific reason (or
    the import error) when any step fails; a CPU the wheel does not suit kills the child instead.
    """
    lu = _liburing()
    try:
        ring = _Ring(2)
    except OSError as exc:
        raise probes.ProbeFailure(*_setup_failure(exc)) from exc
    try:
        supported = lu.probe() or {}
        missing = [op for op in _NEEDED_OPS if not supported.get(op)]
        if missing:
            raise probes.ProbeFailure(probes.ProbeStatus.UNSUPPORTED, f"this kernel's io_uring lacks {', '.join(missing)}")
        lu.io_uring_prep_nop(lu.io_uring_get_sqe(ring.ring))
        ring.submit()
        if not ring.wait(2000):
            raise probes.ProbeFailure(probes.ProbeStatus.FAILED, "a no-op did not complete within 2 s")
        res = ring.reap_one()[1]
        if res != 0:
            raise probes.ProbeFailure(probes.ProbeStatus.FAILED, f"a no-op completed with {res} instead of 0")
    finally:
        ring.close()
    _round_trip()


def _round_trip() -> None:
    """Write 12 KiB as two buffers and read it back as three through the engine; compare bytes and checksums."""
    engine = UringEngine._unprobed(4)
    data = os.urandom(3 * 4096)
    src = [memoryview(bytearray(data[:4096])), memoryview(bytearray(data[4096:]))]
    dst = [memoryview(bytearray(n)) for n in (1000, 8000, 3288)]
    try:
        with tempfile.TemporaryFile() as f:
            (w,) = engine.run([IOOp(OpKind.WRITE, f.fileno(), 0, src)])
            (r,) = engine.run([IOOp(OpKind.READ, f.fileno(), 0, dst)])
    finally:
        engine.close()
    if not (w.ok and r.ok):
        raise probes.ProbeFailure(probes.ProbeStatus.FAILED, f"a file round trip failed: {w.error or r.error}")
    if b"".join(dst) != data or w.checksum != r.checksum or w.nbytes != len(data):
        raise probes.ProbeFailure(probes.ProbeStatus.FAILED, "a file round trip returned other bytes than written")


def _setup_failure(exc: OSError) -> tuple[probes.ProbeStatus, str]:
    """Why ``io_uring_setup`` failed here, as specifically as /proc tells."""
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    if exc.errno in (errno.EPERM, errno.EACCES):
        disabled = probes.proc_text("/proc/sys/kernel/io_uring_disabled")
        if disabled not in ("", "0"):
            why = f"the sysctl kernel.io_uring_disabled = {disabled} forbids it"
        elif probes.proc_text("/proc/self/status", "Seccomp:") not in ("", "0"):
            why = "a seccomp filter (e.g. a container's default profile) blocks io_uring_setup"
        else:
            why = "the kernel refused io_uring_setup"
        return probes.ProbeStatus.DENIED, f"{code}: {why}"
    if exc.errno == errno.ENOSYS:
        return probes.ProbeStatus.DENIED, f"{code}: io_uring_setup is missing (a kernel without io_uring, or seccomp)"
    if exc.errno == errno.ENOMEM:
        limit = probes.proc_text("/proc/self/limits", "Max locked memory")
        return probes.ProbeStatus.MEMLOCK, (f"{code}: no locked memory for a ring (RLIMIT_MEMLOCK: {limit}); raise "
                                            "`ulimit -l` (kernels before 5.12 charge rings to it)")
    return probes.ProbeStatus.FAILED, f"io_uring_setup failed: {exc}"
