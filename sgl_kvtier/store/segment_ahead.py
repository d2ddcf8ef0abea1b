"""Making a directory arena's next segment file ahead of the put path, on a thread of its own.

Creating a segment (``posix_fallocate`` of ``segment_bytes``, then an fsync of its directory) can take a
long time: tmpfs zero-fills it, a network filesystem makes a round trip per block group. ``SegmentAhead``
runs one ``make(seg)`` at a time on a ``kvtier-segment`` thread, so a put reaching the upper part of the
last segment has the next one ready when it gets there. Invariants:

  * At most one making per arena runs at a time, on at most one thread; segments asked for while one runs
    are made after it, in order, by the same thread, which ends once none is left.
  * What a making raised is kept for that segment and handed once to ``failure`` (the put path then
    raises it into its "cannot grow" path, or makes the segment itself); nothing raises on the thread.
  * ``wait`` returns once all asked for is done. ``close`` drops what is not begun and joins the thread (a
    making in flight finishes, its descriptor kept by the arena, which closes it); ``start`` after ``close``
    does nothing. Idempotent.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable

from sgl_kvtier.io.threads import io_thread_started

log = logging.getLogger(__name__)


class SegmentAhead:
    """One arena's maker of segments ahead of need (see the module docstring). ``make(seg)`` creates segment
    ``seg`` unless it exists (the arena serialises it with its own creations) and raises OSError on failure."""

    def __init__(self, make: Callable[[int], object], where: str):
        self._make = make
        self._where = where
        self._lock = threading.Lock()  # guards _queue, _thread, _failed and _closed
        self._queue: list[int] = []  # segments asked for, not yet begun
        self._thread: threading.Thread | None = None  # the thread making them; None when there is nothing to do
        self._making: int | None = None  # the segment the thread is making now
        self._failed: dict[int, OSError] = {}
        self._closed = False

    def start(self, seg: int) -> None:
        """Have ``seg`` made on the thread (after those asked for before), unless it is asked for already,
        failed before (until ``failure`` hands that over), or the maker is closed."""
        with self._lock:
            if self._closed or seg == self._making or seg in self._failed or seg in self._queue:
                return
            self._queue.append(seg)
            if self._thread is not None:
                return  # the running thread takes it next: it leaves only under the lock with nothing queued
            thread = threading.Thread(target=self._run, name="kvtier-segment", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # the process is out of threads: the put path makes it when it gets there
                self._queue.clear()
                return
            self._thread = thread

    def failure(self, seg: int) -> OSError | None:
        """What making ``seg`` ahead raised (once: the next call answers None, so a later put tries again)."""
        with self._lock:
            return self._failed.pop(seg, None)

    def _run(self) -> None:
        io_thread_started()
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = self._making = None
                    return
                seg = self._making = self._queue.pop(0)
            try:
                self._make(seg)
            except OSError as exc:
                self._keep(seg, exc)
            except Exception as exc:  # noqa: BLE001 - a bug must not die silently on the thread: the put path sees it
                log.exception("%s: making segment %d ahead failed", self._where, seg)
                self._keep(seg, OSError(errno.EIO, f"making segment {seg} ahead failed: {exc!r}"))

    def _keep(self, seg: int, exc: OSError) -> None:
        with self._lock:
            self._failed[seg] = exc

    def wait(self) -> None:
        """Return once every segment asked for so far is made (or failed) and the thread has ended."""
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return
            thread.join()

    def close(self) -> None:
        """Drop the segments asked for and not begun, join the making in flight (it completes). Idempotent."""
        with self._lock:
            self._closed = True
            self._queue.clear()
        self.wait()
