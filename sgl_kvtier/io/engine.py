"""``ThreadPoolEngine``: batches of vectored reads/writes as ``os.preadv``/``os.pwritev`` on a thread pool.

The contract every engine keeps (one ``IOResult`` per op, in op order, never raising for a failed op,
xxh3-64 checksums over the buffers in order, range digests and ``before_write``) is set out in ``ops.py``,
with the primitives; they are re-exported here, where most callers import them from. Each op's digests
are taken on the pool thread that moves it (``run_op_blocking``). The syscalls and xxhash release the
GIL, so ``depth`` threads keep ``depth`` ops in flight and hash ``depth`` pages at once. An exception
raised inside an op (only a caller's ``before_write`` can) is raised once every op of the batch ended.
``uring.py`` is the io_uring engine; ``factory.py`` picks one by name and stacks the wrappers.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

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


class ThreadPoolEngine:
    """``os.preadv``/``os.pwritev`` on ``depth`` threads: simple, portable, GIL released in syscalls."""

    name = "threads"

    def __init__(self, depth: int):
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="kvtier-io")

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        """Execute all ops on the pool; results in the order of ``ops``."""
        if len(ops) == 1:
            return [run_op_blocking(ops[0])]
        futures = [self._pool.submit(run_op_blocking, op) for op in ops]
        wait(futures)  # all ended before anything raises: no op may still touch the caller's buffers
        return [f.result() for f in futures]

    def close(self) -> None:
        """Wait for ops in flight, then stop the threads."""
        self._pool.shutdown(wait=True)


__all__ = ["IOEngine", "IOOp", "IOResult", "OpKind", "ThreadPoolEngine", "digest", "op_length", "prepare_write",
           "range_digests", "read_digests", "run_op_blocking", "short_error"]
