"""The primitives every IO engine shares: ops, results, the engine protocol, checksums, the blocking op.

An engine knows nothing of keys, slots or policy. It gets ``IOOp``s (fd, offset, a list of buffers) and
returns one ``IOResult`` per op, in order: bytes moved, the xxh3-64 of the op's bytes when asked for, or
the ``OSError`` that stopped it. An engine never raises for a failed op; the caller decides what a
failure means. Checksums are taken over the buffers in order, so the digest of a page is the same
whether it was moved as one run or as many.

This module imports no engine: ``engine.py`` (threads), ``uring.py`` (io_uring) and the wrappers all
build on it, and ``factory.py`` is the one place that picks and stacks them.
"""

from __future__ import annotations

import enum
import errno
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash


class OpKind(enum.Enum):
    """Which way an op moves bytes."""

    READ = "read"
    WRITE = "write"


@dataclass
class IOOp:
    """One vectored transfer: ``buffers`` (writable for reads) moved back to back from ``offset``."""

    kind: OpKind
    fd: int
    offset: int
    buffers: list[memoryview]
    checksum: bool = True
    device: int = 0  # which of the store's devices (for health tracking and fault injection)


@dataclass
class IOResult:
    """What became of one op: bytes moved, their checksum, or the error that stopped it."""

    nbytes: int = 0
    checksum: int | None = None
    error: OSError | None = None
    short: bool = False  # the device returned fewer bytes than asked: a truncated or torn slot
    seconds: float = 0.0  # time the op spent in the device (0 where the engine does not measure it)

    @property
    def ok(self) -> bool:
        """True when the op moved all its bytes."""
        return self.error is None


class IOEngine(Protocol):
    """Runs batches of ops, many in flight at once."""

    name: str

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        """Execute all ops, many at once; results in the order of ``ops``."""
        ...

    def close(self) -> None:
        """Release the engine's threads or rings; ``run`` must not be called after."""
        ...


def op_length(op: IOOp) -> int:
    """Bytes the op moves when it completes."""
    return sum(b.nbytes for b in op.buffers)


def digest(buffers: Sequence[memoryview]) -> int:
    """xxh3-64 of the buffers' bytes, in order."""
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    return h.intdigest()


def short_error(op: IOOp, done: int) -> OSError:
    """The EIO error of an op that ended (EOF, a torn slot) after ``done`` of its bytes."""
    return OSError(errno.EIO, f"short {op.kind.value}: {done} of {op_length(op)} bytes at offset {op.offset}")


def run_op_blocking(op: IOOp) -> IOResult:
    """One op with plain syscalls, retrying partial transfers; the unit of work of the thread engine."""
    want = op_length(op)
    start = time.perf_counter()
    try:
        crc = digest(op.buffers) if op.checksum and op.kind is OpKind.WRITE else None
        done = _transfer(os.pwritev if op.kind is OpKind.WRITE else os.preadv, op)
        seconds = time.perf_counter() - start
        if done != want:
            return IOResult(done, None, short_error(op, done), short=True, seconds=seconds)
        if op.kind is OpKind.READ and op.checksum:
            crc = digest(op.buffers)
        return IOResult(done, crc, seconds=seconds)
    except OSError as exc:
        return IOResult(0, None, exc, seconds=time.perf_counter() - start)


def _transfer(call: Callable[[int, list[memoryview], int], int], op: IOOp) -> int:
    """Move all buffers, continuing after a partial transfer; stops at EOF (a 0-byte transfer)."""
    buffers, offset, total = list(op.buffers), op.offset, 0
    while buffers:
        n = call(op.fd, buffers, offset)
        if n <= 0:
            break
        total += n
        offset += n
        while buffers and n >= buffers[0].nbytes:
            n -= buffers[0].nbytes
            buffers.pop(0)
        if n:
            buffers[0] = buffers[0][n:]
    return total


__all__ = ["IOEngine", "IOOp", "IOResult", "OpKind", "digest", "op_length", "run_op_blocking", "short_error"]
