"""Read-ahead: pages an exists query found start loading at once into a bounded staging area.

Why: SGLang's prefetch thread asks ``batch_exists`` about a request's span, host slots are allocated only at
the scheduler's next step, and the IO thread then reads one storage batch per ``batch_get_v1`` call. ``stage``
starts every found page's read at the exists query (only reserving budget: the staging job makes the
buffers, so SGLang's thread never waits for memory); ``read`` (the ``get`` path) copies staged pages into
the caller's memory, joining reads in flight, and reads the rest from the store. Each staged key's entry is
READING, then READY (verified bytes in a reused page-aligned buffer) or FAILED.

Invariants:
- Staging yields what ``PageStore.get`` verified; keys name immutable content, so a staged copy stays
  right even if the store evicts the page meanwhile.
- Memory never exceeds the budget; a span's leading keys are staged first (SGLang consumes it in order).
- An entry leaves the table when taken, stale (not taken within ``stale_s``) or closed. A buffer is reused
  only after its read ended: a taker waits for the read; an abandoned entry still reading is freed by its
  job when the read returns.
- A failed staged read is no answer: the taker reads that page from the store itself.
- Staging jobs run on this object's own threads and never raise out of them.
- A streamed tail (``experiments.streaming.tail_stream``) may ``take`` entries without waiting; each is then
  the taker's to ``deliver`` (after its read ended) or ``give_back``. Its ``listener`` is called on the staging
  thread once its entry's read ended, never under our lock.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sgl_kvtier.io.buffers import AlignedBuffer, Run, copy_to_runs, round_up
from sgl_kvtier.io.threads import io_thread_started
from sgl_kvtier.keys import PageKey
from sgl_kvtier.telemetry.counters import RateLimitedLog

log = logging.getLogger(__name__)

Reader = Callable[[Sequence[PageKey], Sequence[Sequence[Run]]], list[bool]]


class EntryState(enum.Enum):
    """Where a staged page is: its read in flight, landed and verified, or failed (read again on demand)."""
    READING = "reading"
    READY = "ready"
    FAILED = "failed"


@dataclass(eq=False)
class _Entry:
    staged_at: float
    done: threading.Event
    buffer: AlignedBuffer | None = None  # set by the staging job before its read
    state: EntryState = EntryState.READING
    abandoned: bool = False  # left the table while READING: the job frees the buffer
    listener: Callable[[], None] | None = None  # a taker's wake-up (``take``), called once the read ended

    def staged_buffer(self) -> AlignedBuffer:
        """The buffer the staging job gave this entry (always set before its read starts)."""
        if self.buffer is None:
            raise RuntimeError("read-ahead entry has no staging buffer")
        return self.buffer


StagedPage = _Entry  # an entry a streamed tail took (``ReadAhead.take``)


@dataclass
class ReadAheadCounters:
    """Pages through the staging area since the shard opened (the ``kvtier_readahead_*`` gauges)."""
    staged: int = 0  # pages whose read was started by an exists query
    served: int = 0  # pages a get took from staging
    joined: int = 0  # ... of which the read was still in flight when asked for
    failed: int = 0  # staged reads that failed (read again on demand)
    dropped: int = 0  # staged pages never asked for (stale, or at close)
    skipped_full: int = 0  # pages not staged because the budget was in use

    def snapshot(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Buffers:
    """The budget: ``limit`` one-page buffers, reserved by count, made on first use, then reused."""

    nbytes: int
    limit: int
    in_use: int = 0  # reserved: by an entry in the table, a job, or a taker
    free: list[AlignedBuffer] = field(default_factory=list)
    made: list[AlignedBuffer] = field(default_factory=list)

    def reserve(self) -> bool:
        if self.in_use >= self.limit:
            return False
        self.in_use += 1
        return True

    def release(self, buf: AlignedBuffer | None) -> None:
        self.in_use -= 1
        if buf is not None:
            self.free.append(buf)


class ReadAhead:
    """Bounded staging for one shard: ``stage`` (at ``batch_exists``) starts reads of the hit's pages into staging
    buffers, ``read`` (at ``batch_get_v1``) takes them or joins their reads, and reads the rest directly."""
    def __init__(self, reader: Reader, page_bytes: int, budget_bytes: int, chunk_pages: int = 32,
                 workers: int = 2, stale_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self._reader = reader
        self.page_bytes = page_bytes
        self._buffers = _Buffers(round_up(page_bytes), budget_bytes // round_up(page_bytes))
        self._chunk = max(1, chunk_pages)
        self._stale_s = stale_s
        self._clock = clock
        self._entries: dict[PageKey, _Entry] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-readahead",
                                        initializer=io_thread_started)
        self._closed = False
        self.counters = ReadAheadCounters()
        self._errlog = RateLimitedLog(log)

    @property
    def enabled(self) -> bool:
        return self._buffers.limit > 0

    # ------------------------------------------------------------------ exists side
    def stage(self, keys: Sequence[PageKey]) -> int:
        """Start reading the leading ``keys`` not staged yet, as far as the budget allows; how many started."""
        if not self.enabled or not keys:
            return 0
        jobs: list[list[tuple[PageKey, _Entry]]] = []
        with self._lock:
            if self._closed:
                return 0
            self._drop_stale()
            batch: list[tuple[PageKey, _Entry]] = []
            for n, key in enumerate(keys):
                if key in self._entries:
                    continue
                if not self._buffers.reserve():
                    self.counters.skipped_full += len(keys) - n
                    break
                entry = _Entry(self._clock(), threading.Event())
                self._entries[key] = entry
                batch.append((key, entry))
                if len(batch) == self._chunk:
                    jobs.append(batch)
                    batch = []
            if batch:
                jobs.append(batch)
            started = sum(len(j) for j in jobs)
            self.counters.staged += started
        for job in jobs:  # in key order: SGLang reads a span front to back
            self._pool.submit(self._read_job, job)
        return started

    def _read_job(self, job: list[tuple[PageKey, _Entry]]) -> None:
        try:
            self._give_buffers([e for _, e in job])
            oks = self._reader([k for k, _ in job], [[(e.staged_buffer().address, self.page_bytes)] for _, e in job])
        except Exception as exc:  # thread boundary: a failed staging read is only a lost head start
            self._errlog.error("kvtier read-ahead of %d pages failed: %s: %s", len(job), type(exc).__name__, exc)
            oks = [False] * len(job)
        with self._lock:
            for (_, entry), ok in zip(job, oks):
                entry.state = EntryState.READY if ok else EntryState.FAILED
                self.counters.failed += not ok
                if entry.abandoned:
                    self._free(entry)
                entry.done.set()
            listeners = [e.listener for _, e in job if e.listener is not None]
        for listener in listeners:  # outside the lock: a taker's wake-up takes its own lock
            try:
                listener()
            except Exception as exc:  # thread boundary: the taker also sees ``done`` when it looks
                self._errlog.error("kvtier read-ahead listener failed: %s: %s", type(exc).__name__, exc)

    def _give_buffers(self, entries: list[_Entry]) -> None:
        with self._lock:
            for entry in entries:
                if self._buffers.free:
                    entry.buffer = self._buffers.free.pop()
            missing = [e for e in entries if e.buffer is None]
        for entry in missing:  # new memory: made and prefaulted here, outside the lock
            buf = AlignedBuffer(self._buffers.nbytes)
            with self._lock:
                self._buffers.made.append(buf)
            entry.buffer = buf

    def _drop_stale(self) -> None:
        """Under the lock: forget entries nobody asked for within ``stale_s``. The table is in staging order
        (insertion order, one clock), so the scan stops at the first fresh entry."""
        horizon = self._clock() - self._stale_s
        stale = []
        for key, entry in self._entries.items():
            if entry.staged_at >= horizon:
                break
            stale.append(key)
        for key in stale:
            self._abandon(self._entries.pop(key))

    def _abandon(self, entry: _Entry) -> None:
        self.counters.dropped += 1
        if entry.state is EntryState.READING:
            entry.abandoned = True
        else:
            self._free(entry)

    def _free(self, entry: _Entry) -> None:
        self._buffers.release(entry.buffer)
        entry.buffer = None

    # ------------------------------------------------------------------ get side
    def read(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]]) -> list[bool]:
        """``PageStore.get`` semantics; staged pages come from staging (waiting for in-flight reads)."""
        with self._lock:
            taken = {i: self._entries.pop(k) for i, k in enumerate(keys) if k in self._entries}
        results = [False] * len(keys)
        direct = [i for i in range(len(keys)) if i not in taken]
        joined = sum(e.state is EntryState.READING for e in taken.values())
        for i, entry in taken.items():
            entry.done.wait()
            if entry.state is EntryState.READY:
                copy_to_runs(entry.staged_buffer().view, pages[i])
                results[i] = True
            else:
                direct.append(i)
            with self._lock:
                self._free(entry)
        with self._lock:
            self.counters.served += sum(results)
            self.counters.joined += joined
        if direct:
            direct.sort()
            for i, ok in zip(direct, self._reader([keys[i] for i in direct], [pages[i] for i in direct])):
                results[i] = ok
        return results

    # ------------------------------------------------------------------ taken whole (streamed tails)
    def take(self, keys: Sequence[PageKey], listener: Callable[[], None]) -> dict[int, StagedPage]:
        """Without waiting: the staged entries of ``keys`` (by index in ``keys``), out of the table. Each is the
        caller's: ``deliver`` it once ``done`` is set (``listener`` is called then, on the staging thread, for
        an entry still READING now), or ``give_back`` it."""
        with self._lock:
            taken = {i: self._entries.pop(k) for i, k in enumerate(keys) if k in self._entries}
            for entry in taken.values():
                if entry.state is EntryState.READING:
                    entry.listener = listener
            return taken

    def deliver(self, entry: StagedPage, pages: Sequence[Run]) -> bool:
        """A taken entry whose read ended: its verified bytes copied into ``pages`` (True), or False (the
        staged read failed: the caller reads that page itself). Its buffer is free again either way."""
        entry.done.wait()  # set already when the caller follows ``take``'s rule; never a long wait
        ok = entry.state is EntryState.READY
        if ok:
            copy_to_runs(entry.staged_buffer().view, pages)
        with self._lock:
            self._free(entry)
            self.counters.served += ok
            self.counters.joined += ok and entry.listener is not None
        return ok

    def give_back(self, entry: StagedPage) -> None:
        """A taken entry not delivered (its taker gave up): freed now, or by its job once its read returns."""
        with self._lock:
            entry.listener = None
            self._abandon(entry)

    # ------------------------------------------------------------------ lifecycle
    def staged_keys(self) -> int:
        with self._lock:
            return len(self._entries)

    def buffers_in_use(self) -> int:
        with self._lock:
            return self._buffers.in_use

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters.snapshot(), "staged_now": len(self._entries),
                    "buffers_in_use": self._buffers.in_use, "buffer_limit": self._buffers.limit}

    def close(self) -> None:
        """Wait for reads in flight, then free all staging memory; later calls stage nothing."""
        with self._lock:
            self._closed = True
            for entry in self._entries.values():
                self._abandon(entry)
            self._entries.clear()
        self._pool.shutdown(wait=True)
        with self._lock:
            for buf in self._buffers.made:
                buf.close()
            self._buffers.made.clear()
            self._buffers.free.clear()
