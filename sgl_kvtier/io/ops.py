"""The primitives every IO engine shares: ops, results, the engine protocol, checksums, the blocking op.

An engine knows nothing of keys, slots or policy: it gets ``IOOp``s (fd, offset, buffers) and returns one
``IOResult`` per op, in order (bytes moved, the xxh3-64 of the op's bytes when asked, or the ``OSError``
that stopped it), never raising for a failed op. Digests run over the buffers in order, so a page's digest
does not depend on how it was split. An op's ``digest_ranges`` are digested too (``part_digests``), for a
read after its last byte arrived, for a write before its first byte goes out (``prepare_write``), when its
``before_write`` gets them and may fill bytes outside the ranges (a slot trailer goes out in the same IO).
Both run on the engine's IO thread, never while the op's bytes move. A failed or short op has no range
digests; a write an injected fault stopped may never have called ``before_write``. An exception from
``before_write`` (a bug) is raised by ``run`` once every op of the batch ended. No engine is imported here.
"""

from __future__ import annotations

import enum
import errno
import os
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import xxhash

_EMPTY = xxhash.xxh3_64_intdigest(b"")


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
    # (start, length) byte ranges of the op's bytes, each digested on its own (module docstring); None: none
    digest_ranges: Sequence[tuple[int, int]] | None = None
    # A write's: called with the ranges' digests before its bytes go out (fills e.g. a trailer in its buffers)
    before_write: Callable[[list[int]], None] | None = None
    # The read group of a group-major read the op belongs to (store.part_reads); None: any other op. Only
    # fault injection looks at it (``io.faulty``: ``from_group``).
    group: int | None = None


@dataclass
class IOResult:
    """What became of one op: bytes moved, their checksum, or the error that stopped it."""

    nbytes: int = 0
    checksum: int | None = None
    error: OSError | None = None
    short: bool = False  # the device returned fewer bytes than asked: a truncated or torn slot
    seconds: float = 0.0  # time the op spent in the device (0 where the engine does not measure it)
    part_digests: list[int] | None = None  # xxh3-64 of each of the op's ``digest_ranges``, when it had some

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


def range_digests(buffers: Sequence[memoryview], ranges: Sequence[tuple[int, int]]) -> list[int]:
    """xxh3-64 of each ``(start, length)`` range of the buffers' bytes taken back to back, in the order of
    ``ranges`` (which may cross buffer boundaries, overlap or leave bytes out). A range within one buffer
    is hashed in one call, without a hasher object. Raises ValueError for a range outside the bytes."""
    ends = list(accumulate(b.nbytes for b in buffers))
    total = ends[-1] if ends else 0
    out: list[int] = []
    for start, length in ranges:
        stop = start + length
        if start < 0 or length < 0 or stop > total:
            raise ValueError(f"digest range ({start}, {length}) outside the op's {total} bytes")
        if length == 0:
            out.append(_EMPTY)
            continue
        i = bisect_right(ends, start)  # the buffer holding byte ``start``
        lo = start - (ends[i] - buffers[i].nbytes)
        if stop <= ends[i]:
            out.append(xxhash.xxh3_64_intdigest(buffers[i][lo:lo + length]))
            continue
        h = xxhash.xxh3_64(buffers[i][lo:])
        i += 1
        while ends[i] < stop:
            h.update(buffers[i])
            i += 1
        h.update(buffers[i][:stop - (ends[i] - buffers[i].nbytes)])
        out.append(h.intdigest())
    return out


def prepare_write(op: IOOp) -> list[int] | None:
    """Before a write's bytes go out: its range digests (None when it has no ``digest_ranges``), handed to
    its ``before_write`` (with ``[]`` when it has no ranges). Every engine calls this once per write it sends."""
    parts = None if op.digest_ranges is None else range_digests(op.buffers, op.digest_ranges)
    if op.before_write is not None:
        op.before_write([] if parts is None else parts)
    return parts


def read_digests(op: IOOp) -> tuple[int | None, list[int] | None]:
    """A read's whole digest (None unless ``checksum``) and range digests (None without ranges), taken
    once its bytes are in its buffers."""
    return (digest(op.buffers) if op.checksum else None,
            None if op.digest_ranges is None else range_digests(op.buffers, op.digest_ranges))


def short_error(op: IOOp, done: int) -> OSError:
    """The EIO error of an op that ended (EOF, a torn slot) after ``done`` of its bytes."""
    return OSError(errno.EIO, f"short {op.kind.value}: {done} of {op_length(op)} bytes at offset {op.offset}")


def run_op_blocking(op: IOOp) -> IOResult:
    """One op with plain syscalls, retrying partial transfers; the unit of work of the thread engine."""
    want = op_length(op)
    write = op.kind is OpKind.WRITE
    crc, parts = None, None
    if write:  # digests (and the caller's ``before_write``) before the clock: ``seconds`` is device time
        parts = prepare_write(op) if op.digest_ranges is not None or op.before_write is not None else None
        crc = digest(op.buffers) if op.checksum else None
    start = time.perf_counter()
    try:
        done = _transfer(os.pwritev if write else os.preadv, op, want)
        seconds = time.perf_counter() - start
        if done != want:
            return IOResult(done, None, short_error(op, done), short=True, seconds=seconds)
        if not write and (op.checksum or op.digest_ranges is not None):
            crc, parts = read_digests(op)
        return IOResult(done, crc, seconds=seconds, part_digests=parts)
    except OSError as exc:
        return IOResult(0, None, exc, seconds=time.perf_counter() - start)


def _transfer(call: Callable[[int, list[memoryview], int], int], op: IOOp, want: int) -> int:
    """Move the op's ``want`` bytes, continuing after a partial transfer; stops at EOF (a 0-byte transfer)."""
    buffers, offset, total = list(op.buffers), op.offset, 0
    while buffers:
        n = call(op.fd, buffers, offset)
        if n <= 0:
            break
        total += n
        if total == want:  # the usual op: everything in one call, no bookkeeping of the buffers
            break
        offset += n
        while buffers and n >= buffers[0].nbytes:
            n -= buffers[0].nbytes
            buffers.pop(0)
        if n:
            buffers[0] = buffers[0][n:]
    return total


__all__ = ["IOEngine", "IOOp", "IOResult", "OpKind", "digest", "op_length", "prepare_write", "range_digests",
           "read_digests", "run_op_blocking", "short_error"]
