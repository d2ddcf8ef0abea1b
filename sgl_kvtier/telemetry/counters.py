"""Counters and stats of a page store, an error log that cannot flood, and the error boundary.

Counters are plain ints bumped under the store's lock; ``snapshot`` copies them for reporting.
``ErrorBoundary`` is where our code meets a thread that is not ours (SGLang's): every exception that
reaches it is counted by kind and logged at a bounded rate per kind, an unexpected one (a bug) always
with its traceback, so a traceback through ``sgl_kvtier`` in a server log means a bug, never an IO fault.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from dataclasses import dataclass, field


@dataclass
class StoreCounters:
    """Running totals of one page store since it opened."""

    put_pages: int = 0  # pages written
    put_present: int = 0  # offered pages already stored (or being stored): skipped
    put_declined: int = 0  # offered pages the admission filter turned away
    put_no_space: int = 0  # pages refused because nothing could be evicted
    get_hits: int = 0
    get_misses: int = 0
    corrupt_pages: int = 0  # failed checksum or short read: dropped, served as a miss
    remote_reuse_races: int = 0  # another writer's page whose slot its owner reused under our read: a miss
    segments_reopened: int = 0  # a peer's segment files opened afresh after a page failed (``store.renewal``)
    fresh_rereads: int = 0  # pages that failed through an old descriptor and verified through a fresh one
    io_errors: int = 0
    evictions: int = 0
    bad_requests: int = 0  # wrong key length, page size mismatch
    bytes_written: int = 0
    bytes_read: int = 0
    parts_read: int = 0  # parts of pages read group-major (``get_parts``) and verified
    parts_failed: int = 0  # such parts whose IO failed, came short or failed their checksum

    def snapshot(self) -> dict[str, int]:
        """A copy of the counters by field name."""
        return dataclasses.asdict(self)


@dataclass
class StoreStats:
    """What a page store reports about itself: identity, occupancy, and a copy of its counters."""

    namespace: str
    devices: list[str]
    direct_io: bool
    engine: str
    pages: int
    slot_bytes: int
    bytes_used: int
    capacity_bytes: int
    counters: dict[str, int] = field(default_factory=dict)


class RateLimitedLog:
    """Logs at most ``burst`` messages per ``window`` seconds, then one summary of what it held back."""

    def __init__(self, logger: logging.Logger, burst: int = 10, window: float = 60.0):
        self._log = logger
        self._burst = burst
        self._window = window
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._count = 0
        self._suppressed = 0

    def error(self, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        """Log ``msg % args`` at ERROR (with ``exc_info``'s traceback when given) unless over the budget."""
        with self._lock:
            now = time.monotonic()
            if now - self._window_start >= self._window:
                if self._suppressed:
                    self._log.error("(%d similar errors suppressed in the last %.0f s)", self._suppressed, self._window)
                self._window_start, self._count, self._suppressed = now, 0, 0
            self._count += 1
            if self._count > self._burst:
                self._suppressed += 1
                return
        self._log.error(msg, *args, exc_info=exc_info)


class ErrorKind(enum.Enum):
    """How an exception that reached the boundary is classed (and logged)."""

    EXPECTED = "expected"  # an IO fault, a bad argument, a store refusal: one line, no traceback
    UNEXPECTED = "unexpected"  # anything else, i.e. a bug: logged with its traceback


@dataclass(frozen=True)
class BoundaryCounts:
    """Exceptions an ``ErrorBoundary`` caught so far, by kind."""

    expected: int = 0
    unexpected: int = 0

    @property
    def total(self) -> int:
        """All caught exceptions."""
        return self.expected + self.unexpected


class ErrorBoundary:
    """Counts and logs the exceptions caught where our code returns to a caller that must not see them.

    ``expected`` are the exception types our own code raises on purpose (faults, bad input); any other
    ``Exception`` is a bug. Both are caught by the caller, which then answers its fallback (a miss).
    """

    def __init__(self, logger: logging.Logger, expected: tuple[type[BaseException], ...] = (),
                 burst: int = 10, window: float = 60.0):
        self._expected = expected
        self._lock = threading.Lock()
        self._counts = {kind: 0 for kind in ErrorKind}
        self._logs = {kind: RateLimitedLog(logger, burst, window) for kind in ErrorKind}

    def fail(self, op: str, exc: BaseException, outcome: str = "served as a miss") -> ErrorKind:
        """Count ``exc`` (raised by ``op``), log it rate-limited, and say how it was classed."""
        kind = ErrorKind.EXPECTED if isinstance(exc, self._expected) else ErrorKind.UNEXPECTED
        with self._lock:
            self._counts[kind] += 1
        # The message's arguments are strings: a log record a handler keeps (a buffer, a test's capture) must not
        # keep ``exc``, whose traceback holds every frame it passed and their locals (a closed backend, its host
        # pool). Only a bug's record keeps it, for its traceback.
        if kind is ErrorKind.EXPECTED:
            self._logs[kind].error("kvtier %s failed (%s): %s: %s", op, outcome, type(exc).__name__, str(exc))
        else:
            self._logs[kind].error("kvtier %s failed (%s), unexpected %s: %s", op, outcome, type(exc).__name__,
                                   str(exc), exc_info=exc)
        return kind

    def counts(self) -> BoundaryCounts:
        """A consistent copy of the counters."""
        with self._lock:
            return BoundaryCounts(self._counts[ErrorKind.EXPECTED], self._counts[ErrorKind.UNEXPECTED])
