"""``ThreadPoolEngine``: batches of vectored reads/writes as ``os.preadv``/``os.pwritev`` on a thread pool.

The contract every engine keeps (one ``IOResult`` per op, in op order, never raising for a failed op,
xxh3-64 checksums over the buffers in order, range digests and ``before_write``) is set out in ``ops.py``,
with the primitives; they are re-exported here, where most callers import them from. Each op's digests
are taken on the pool thread that moves it (``run_op_blocking``). The syscalls and xxhash release the
GIL, so ``depth`` threads keep ``depth`` ops in flight and hash ``depth`` pages at once. An exception
raised inside an op (only a caller's ``before_write`` can) is raised once every op of the batch ended.
``in_flight`` (both engines): the ops handed to the engine whose IO has not ended; 0 whenever no ``run``
is in progress, whatever ``run`` returned or raised (tests read it to prove that).
``uring.py`` is the io_uring engine; ``factory.py`` picks one by name and stacks the wrappers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from sgl_kvtier.io.ops import (
    IOEngine,
    IOOp,
    IOResult,
    OpKind,
    digest,
    op_length,
    prepare_write,
    range_digests,
    read_digests,
    run_op_blocking,
    short_error,
)
from sgl_kvtier.io.threads import io_thread_started


class ThreadPoolEngine:
    """``os.preadv``/``os.pwritev`` on ``depth`` threads: simple, portable, GIL released in syscalls."""

    name = "threads"

    def __init__(self, depth: int):
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="kvtier-io",
                                        initializer=io_thread_started)  # named, KVTIER_IO_NICE (io.threads)
        self._moving = 0  # ops handed over (queued or running) whose IO has not ended
        self._count = threading.Lock()

    @property
    def in_flight(self) -> int:
        """Ops handed to this engine whose IO has not ended (see the module docstring)."""
        with self._count:
            return self._moving

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        """Execute all ops on the pool; results in the order of ``ops``."""
        with self._count:
            self._moving += len(ops)  # counted before any is handed over, uncounted by each as it ends
        if len(ops) == 1:
            return [self._op(ops[0])]
        futures: list[Future[IOResult]] = []
        try:
            for op in ops:
                futures.append(self._pool.submit(self._op, op))
        finally:
            with self._count:
                self._moving -= len(ops) - len(futures)  # never handed over (a pool shut down): not moving
        wait(futures)  # all ended before anything raises: no op may still touch the caller's buffers
        return [f.result() for f in futures]

    def _op(self, op: IOOp) -> IOResult:
        try:
            return run_op_blocking(op)
        finally:
            with self._count:
                self._moving -= 1  # after the syscall returned (or the op raised): its IO has ended

    def close(self) -> None:
        """Wait for ops in flight, then stop the threads."""
        self._pool.shutdown(wait=True)


__all__ = ["IOEngine", "IOOp", "IOResult", "OpKind", "ThreadPoolEngine", "digest", "op_length", "prepare_write",
           "range_digests", "read_digests", "run_op_blocking", "short_error"]
