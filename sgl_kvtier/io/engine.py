"""``ThreadPoolEngine``: batches of vectored reads/writes as ``os.preadv``/``os.pwritev`` on a thread pool.

The contract every engine keeps (one ``IOResult`` per op, in op order, never raising for a failed op;
checksums, range digests and ``before_write``) is set out in ``ops.py``, whose primitives are re-exported
here. Each op's digests are taken on the pool thread that moves it; syscalls and xxhash release the GIL,
so ``depth`` threads keep ``depth`` ops in flight. An exception raised inside an op (only a caller's
``before_write`` can) is raised once every op of the batch ended. ``in_flight`` (both engines) counts ops
handed over whose IO has not ended: 0 whenever no ``run`` is in progress, however ``run`` ended.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Sequence

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


class _Batch:
    """One ``run``'s ops. Workers take ops by index (``take``) until none is left; the op that ends last sets
    ``done``. Results land by index; an exception an op raised is kept by index and raised by ``run``."""

    __slots__ = ("ops", "results", "errors", "left", "done", "_next")

    def __init__(self, ops: Sequence[IOOp]) -> None:
        self.ops = ops
        self.results: list[IOResult | None] = [None] * len(ops)
        self.errors: dict[int, BaseException] = {}
        self.left = len(ops)  # ops not yet ended (guarded by the engine's lock)
        self.done = threading.Event()
        self._next = itertools.count()  # ``next`` is atomic: one C call under the GIL

    def take(self) -> int | None:
        """The index of an op no worker has taken, or None when every op is taken."""
        i = next(self._next)
        return i if i < len(self.ops) else None


class ThreadPoolEngine:
    """``os.preadv``/``os.pwritev`` on ``depth`` threads: simple, portable, GIL released in syscalls.

    A batch is handed to ``min(depth, ops)`` workers at once (one queue entry each, no future per op); each
    takes ops by index until none is left, so a batch costs one wake-up per worker, not per op. Workers
    start on first use, named ``kvtier-io_N``; daemon threads, so a process that never closes its engine
    still exits.
    """

    name = "threads"

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._moving = 0  # ops handed over (queued or running) whose IO has not ended
        self._count = threading.Lock()  # guards _moving, each batch's ``left``, _workers and _closed
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Ops handed to this engine whose IO has not ended (see the module docstring)."""
        with self._count:
            return self._moving

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        """Execute all ops on the workers; results in the order of ``ops``. Raises RuntimeError once closed."""
        if not ops:
            return []
        batch = _Batch(ops)
        with self._count:  # closed, counted and queued in one step: ``close`` never strands a batch
            if self._closed:
                raise RuntimeError("the IO engine is closed")
            helpers = min(self.depth, len(ops)) if len(ops) > 1 else 0
            self._start_workers(helpers)  # before counting: a failure to start leaves nothing counted
            self._moving += len(ops)  # counted before any is handed over, uncounted by each as it ends
            for _ in range(helpers):
                self._queue.put(batch)
        if len(ops) == 1:
            self._drain(batch)  # one op: on the calling thread, no hand-over
        batch.done.wait()  # every op ended before anything raises: no op may still touch the caller's buffers
        if batch.errors:
            raise batch.errors[min(batch.errors)]
        return batch.results  # type: ignore[return-value]  # every slot filled: each op ended without raising

    def _start_workers(self, n: int) -> None:
        """Up to ``n`` workers (under ``_count``). Where a thread cannot start, the ones running serve."""
        while len(self._workers) < n:
            worker = threading.Thread(target=self._work, name=f"kvtier-io_{len(self._workers)}", daemon=True)
            try:
                worker.start()
            except RuntimeError:  # the process is out of threads
                if self._workers:
                    return
                raise
            self._workers.append(worker)

    def _work(self) -> None:
        io_thread_started()  # named, KVTIER_GIL_SWITCH_US (io.threads)
        while (batch := self._queue.get()) is not None:
            self._drain(batch)

    def _drain(self, batch: _Batch) -> None:
        """Run the batch's ops not yet taken, one after another, until none is left."""
        while (i := batch.take()) is not None:
            try:
                batch.results[i] = run_op_blocking(batch.ops[i])
            except BaseException as exc:  # noqa: B036 - only a caller's before_write raises: handed to run
                batch.errors[i] = exc
            finally:
                with self._count:
                    self._moving -= 1  # after the syscall returned (or the op raised): its IO has ended
                    batch.left -= 1
                    if batch.left == 0:
                        batch.done.set()

    def close(self) -> None:
        """Wait for ops in flight, then stop the threads (idempotent)."""
        with self._count:
            workers, self._closed = (list(self._workers) if not self._closed else []), True
            for _ in workers:
                self._queue.put(None)  # after every batch queued: each is drained before a worker stops
        for worker in workers:
            worker.join()


__all__ = ["IOEngine", "IOOp", "IOResult", "OpKind", "ThreadPoolEngine", "digest", "op_length", "prepare_write",
           "range_digests", "read_digests", "run_op_blocking", "short_error"]
