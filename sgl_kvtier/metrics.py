"""Counters and stats of a page store, and an error log that cannot flood.

Counters are plain ints bumped under the store's lock; ``snapshot`` copies them for reporting.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field


@dataclass
class StoreCounters:
    put_pages: int = 0  # pages written
    put_present: int = 0  # offered pages already stored (or being stored): skipped
    put_declined: int = 0  # offered pages the admission filter turned away
    put_no_space: int = 0  # pages refused because nothing could be evicted
    get_hits: int = 0
    get_misses: int = 0
    corrupt_pages: int = 0  # failed checksum or short read: dropped, served as a miss
    io_errors: int = 0
    evictions: int = 0
    bad_requests: int = 0  # wrong key length, page size mismatch
    bytes_written: int = 0
    bytes_read: int = 0

    def snapshot(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass
class StoreStats:
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

    def error(self, msg: str, *args: object) -> None:
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
        self._log.error(msg, *args)
