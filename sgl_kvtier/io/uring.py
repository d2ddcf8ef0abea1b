"""``UringEngine``: batches of vectored reads/writes through io_uring (the PyPI ``liburing`` package).

Invariants (the contract of ``ThreadPoolEngine``, see ``engine.py``):

* ``run(ops)`` returns one ``IOResult`` per op, in op order, and never raises for a failed op: a negative
  completion becomes ``OSError(-res)`` (EINTR/EAGAIN are retried); a 0-byte transfer before the op is
  complete (EOF) ends it with ``short=True`` and an EIO error, as ``run_op_blocking`` does. A partial
  transfer is resubmitted from ``offset + n`` with the remaining buffer slices.
* Checksums are ``digest(op.buffers)`` (xxh3-64, buffers in order): for writes taken before submission,
  for reads after the op's last completion. Failed and short ops carry none.
* At most ``depth`` ops are in flight per ring. Each ``Iovec`` and buffer slice given to the kernel stays
  referenced from the in-flight table until its completion is reaped; ``run`` waits for every in-flight
  completion before it returns, also when it leaves by an exception.
* Completions are reaped one at a time (``cqe[0]``, then ``io_uring_cqe_seen``): this binding's ``cqe[i]``
  ignores ring wrap-around, which is why reaping several by index gave bogus results.
* The binding holds the GIL inside ``io_uring_wait_cqe``, so we never block there but in ``poll()`` on
  the ring fd, which releases the GIL (SGLang's scheduler and the other IO threads keep running).

Threads: SGLang calls ``run`` from up to three threads at once; each ``run`` checks a ring out of a pool
(making one when all are busy) and puts it back after, so a ring is used by one thread at a time. One
ring behind a lock would make a small prefetch wait behind a large write-back batch; a ring per
``threading.local`` would leak the rings of exited threads, out of reach of ``close()``.
"""
from __future__ import annotations

import errno
import os
import select
import threading
from collections import deque
from typing import Sequence

from sgl_kvtier.io.engine import IOOp, IOResult, OpKind, _short, digest, op_length, run_op_blocking

try:
    import liburing as _lu
except Exception:  # not installed, or the native module cannot load here
    _lu = None

_RETRY = (errno.EINTR, errno.EAGAIN)
_MAX_TRIES = 16


class _Ring:
    """One io_uring instance, waited on without holding the GIL."""

    def __init__(self, depth: int):
        self.ring = _lu.Ring()
        _lu.io_uring_queue_init(depth, self.ring)  # an SQE failing at submit stops it: see submit()
        self.cqe = _lu.Cqe()
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
        user_data = entry.user_data
        try:
            res = entry.res  # the binding raises OSError for a negative res
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
        _lu.io_uring_queue_exit(self.ring)


class _Xfer:
    """One op in flight: what is left to move, and what the kernel may touch (kept alive here)."""

    __slots__ = ("op", "bufs", "offset", "done", "want", "crc", "iov", "tries")

    def __init__(self, op: IOOp, want: int, crc: int | None):
        self.op, self.bufs, self.offset = op, list(op.buffers), op.offset
        self.done, self.want, self.crc, self.iov, self.tries = 0, want, crc, None, 0

    def prep(self, ring: _Ring, user_data: int) -> None:
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
            return IOResult(self.done, None, _short(self.op, self.done), short=True)
        self.done, self.offset, n = self.done + res, self.offset + res, res
        while self.bufs and n >= self.bufs[0].nbytes:  # drop what moved; resume inside a buffer
            n -= self.bufs.pop(0).nbytes
        if n:
            self.bufs[0] = self.bufs[0][n:]
        if self.done < self.want:
            return None
        return IOResult(self.done, self.crc)


def _start(op: IOOp) -> _Xfer | IOResult:
    """An ``_Xfer`` ready to prep, or the op's result when it is settled without IO."""
    want = op_length(op)
    if not (0 <= op.fd < 2**31 and 0 <= op.offset < 2**63):
        bad = errno.EINVAL if 0 <= op.fd < 2**31 else errno.EBADF
        return IOResult(0, None, OSError(bad, os.strerror(bad)))
    if want == 0:
        return IOResult(0, digest(op.buffers) if op.checksum else None)
    x = _Xfer(op, want, digest(op.buffers) if op.kind is OpKind.WRITE and op.checksum else None)
    try:
        x.iov = _lu.Iovec(x.bufs)
    except (TypeError, ValueError) as exc:  # not buffers, or more than IOV_MAX of them
        return IOResult(0, None, OSError(errno.EINVAL, f"{os.strerror(errno.EINVAL)}: {exc}"))
    return x


class UringEngine:
    """io_uring, ``depth`` ops in flight per concurrent caller; moves caller memory in place."""

    name = "uring"
    _probed: bool | None = None

    def __init__(self, depth: int):
        if _lu is None:
            raise ImportError("the liburing package is not importable")
        self.depth = max(1, int(depth))
        self._lock = threading.Lock()
        self._closed = False
        self._idle: list[_Ring] = [_Ring(self.depth)]  # fail here, not in run(), if rings cannot be made

    @classmethod
    def probe(cls) -> bool:
        """True when a ring can be set up and a no-op round-trips here. Never raises; cached."""
        if cls._probed is None:
            cls._probed = _probe()
        return cls._probed

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
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
        results: list = [None] * len(ops)
        todo = deque(range(len(ops)))
        inflight: dict[int, _Xfer] = {}  # user_data (= op index) -> transfer; holds buffers and iovecs
        prepped = 0  # SQEs prepared, not yet submitted; all of them are also in ``inflight``
        unhashed: list[int] = []  # reads moved in full whose checksum is still to be taken
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
                for i in unhashed:  # hash once the device has work again, not while it idles
                    results[i].checksum = digest(ops[i].buffers)
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
                        if result.ok and op.kind is OpKind.READ and op.checksum:
                            unhashed.append(i)
        finally:
            if inflight:
                _drain(ring, inflight)
        return results


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


def _probe() -> bool:
    if _lu is None:
        return False
    try:
        supported = _lu.probe()
        if not (supported.get("IORING_OP_READV") and supported.get("IORING_OP_WRITEV")):
            return False
        ring = _Ring(2)
        try:
            _lu.io_uring_prep_nop(_lu.io_uring_get_sqe(ring.ring))
            _lu.io_uring_submit(ring.ring)
            return ring.wait(2000) and ring.reap_one()[1] == 0
        finally:
            ring.close()
    except Exception:  # seccomp (EPERM/ENOSYS), kernel.io_uring_disabled, memlock limits, old binding
        return False
