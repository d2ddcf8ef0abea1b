"""``ThreadPoolEngine``: batches of vectored reads/writes as ``os.preadv``/``os.pwritev`` on a thread pool.

The contract every engine keeps (one ``IOResult`` per op, in op order, never raising for a failed op,
xxh3-64 checksums over the buffers in order) is set out in ``ops.py``, with the primitives; they are
re-exported here, where most callers import them from. The syscalls and xxhash release the GIL, so
``depth`` threads keep ``depth`` ops in flight. ``uring.py`` is the io_uring engine; ``factory.py`` picks
one by name and stacks the wrappers.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from sgl_kvtier.io.ops import IOEngine, IOOp, IOResult, OpKind, digest, op_length, run_op_blocking, short_error


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
        return list(self._pool.map(run_op_blocking, ops))

    def close(self) -> None:
        """Wait for ops in flight, then stop the threads."""
        self._pool.shutdown(wait=True)


__all__ = ["IOEngine", "IOOp", "IOResult", "OpKind", "ThreadPoolEngine", "digest", "op_length", "run_op_blocking",
           "short_error"]
