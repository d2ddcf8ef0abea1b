"""One bound hit read group-major, verified group by group, straight into the host slots SGLang allocated for
it (implements ``contract.TailStream``).

One ``TailStream`` per bound hit (``binding.StreamBinder.bind``), run on a thread of the binder's small executor
(a stream queued behind others is still correct, just later). Its groups are *read groups* (the stored layer
groups merged in ``cuts``, ``rules.read_groups``); everything below counts in read groups. Its thread:

1. takes the hit's pages that read-ahead staged (``ReadAhead.take``) and copies those whose staged read ended
   into their slots, whole;
2. reads every other page group-major (``group_reads.read_layer_groups``), recording after each group which
   pages verified it, and between groups copies the staged pages whose read ended meanwhile;
3. waits for the staged reads still in flight (woken by read-ahead's listener or by ``cancel``) and copies
   them; a failed staged read is no answer: those pages are read group-major from the store after.

Per page, under the stream's condition: ``done`` (leading groups verified in its slots), ``failed`` (the first
group that will not land) and ``settled`` (its slots get no more writes from this stream). Rules:

- Group g of a page is LANDED only once its verified bytes are in its slots (``done > g``); ``failed`` is final
  and ``done`` only grows, so ``landed_pages`` is monotonic and a landed page is settled. A page that failed in
  read group g settles once group g + 1 landed (the store issues g + 1 before g's verdicts, ``part_reads``), or
  at the end.
- ``wait_group(g, first_page)``: LANDED when every page from ``first_page`` has g verified, FAILED as soon as one
  of them failed at g or earlier, else it waits (TIMEOUT). Once the stream ended every wait is decided.
- ``cancel``: every group not landed is FAILED at once and no new IO starts (a private exception out of
  ``on_group`` stops ``get_parts`` once the IO in flight landed). A cancel that arrives while ``get_parts`` waits
  for group g can no longer stop g + 1 being issued (``part_reads.drive`` starts it first): that IO lands, then
  the read stops.
- ``ended``: set last, after every page settled: no IO into the slots is in flight and none will be issued
  (also when the thread never ran: cancelled while queued, or refused by the executor).
- Exceptions of the store or our code are caught on the thread: every group not landed is FAILED, the stream
  ends and the error is counted on the backend's ``ErrorBoundary``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_kvtier.errors import KVTierError
from sgl_kvtier.experiments.streaming import contract
from sgl_kvtier.experiments.streaming.contract import GroupVerdict
from sgl_kvtier.experiments.streaming.rules.read_groups import Cuts
from sgl_kvtier.io.buffers import Run
from sgl_kvtier.keys import PageKey
from sgl_kvtier.prefetch.readahead import ReadAhead, StagedPage
from sgl_kvtier.sglang.group_reads import read_layer_groups
from sgl_kvtier.sglang.host_pages import check_indices
from sgl_kvtier.sglang.host_shard import HostShard
from sgl_kvtier.telemetry.counters import ErrorBoundary

Observer = Callable[["TailStream", int], None]  # (stream, group) on the stream's thread after g is recorded


class _Cancelled(Exception):
    """Raised out of ``on_group`` (and between staged copies) once the stream is cancelled."""


@dataclass(frozen=True)
class StreamSummary:
    """What one ended stream did (the binder's counters)."""

    pages: int
    landed: int  # pages with every group verified in their slots (group-major or staged)
    staged: int  # ... of which copied whole from read-ahead
    failed_pages: int  # pages that did not land (read error, checksum, missing, cancel, error)
    failed_groups: int  # layer groups that did not land on every page
    cancelled: bool
    error: bool  # the read raised (counted on the boundary)


class TailStream:
    """One bound hit streaming into its host slots (module docstring; implements ``contract.TailStream``)."""

    def __init__(self, tier: HostShard, keys: Sequence[PageKey], host_indices: torch.Tensor, executor: Executor,
                 boundary: ErrorBoundary, observer: Observer | None = None,
                 on_end: Callable[[TailStream], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, cuts: Cuts | None = None):
        stored = tier.pages.plan
        if stored is None:
            raise KVTierError(f"pool {tier.name} ({tier.pages.layout}) does not stream in layer groups")
        plan = stored.reads(stored.group_count) if cuts is None else stored.read_in(cuts)
        problem = check_indices(host_indices, len(keys), tier.pages.page_tokens)
        if problem is not None:
            raise ValueError(problem)
        self._tier = tier
        self._plan = plan
        self.keys: tuple[PageKey, ...] = tuple(keys)
        self._slots = host_indices
        self._executor = executor
        self._boundary = boundary
        self._observer = observer
        self._on_end = on_end
        self._clock = clock
        n, g = len(self.keys), plan.group_count
        self._group_bytes = [sum(plan.parts[p] for p in parts) for parts in plan.groups]
        self._tail_bytes = [sum(self._group_bytes[i:]) for i in range(g + 1)]  # bytes of groups >= i
        self._done = [0] * n
        self._failed: list[int | None] = [None] * n
        self._failed_in: list[int | None] = [None] * n  # the read group a page failed in (store-side failures)
        self._settled = [False] * n
        self._landed = 0  # leading pages with every group verified
        self._bytes = 0  # verified bytes landed
        self._began: float | None = None  # the thread began reading
        self._first_at: float | None = None  # the first bytes landed
        self._first_bytes = 0  # verified bytes landed by then
        self._cond = threading.Condition()
        self._started = self._running = self._cancelled = self._ended = False
        self._reported = False
        self._error = False
        self._pending: dict[int, StagedPage] = {}  # staged pages taken, not copied yet (stream thread only)
        self._staged = 0
        self._fallback: list[int] = []  # staged pages whose staged read failed: read from the store after

    # ------------------------------------------------------------------ contract.TailStream
    @property
    def pages(self) -> int:
        return len(self.keys)

    @property
    def groups(self) -> int:
        return self._plan.group_count

    @property
    def host_indices(self) -> torch.Tensor:
        return self._slots

    @property
    def page_tokens(self) -> int:
        return self._tier.pages.page_tokens

    def layers(self, group: int) -> range:
        return self._plan.layers(group)

    def landed_pages(self) -> int:
        with self._cond:
            return self._landed

    def wait_group(self, group: int, first_page: int, timeout: float | None) -> GroupVerdict:
        if not 0 <= group < self.groups:
            raise ValueError(f"group {group} is not in 0..{self.groups - 1}")
        first = max(0, first_page)
        found: list[GroupVerdict] = []

        def decided() -> bool:
            verdict = self._verdict(group, first)
            if verdict is not None:
                found.append(verdict)
            return verdict is not None

        with self._cond:
            self._cond.wait_for(decided, timeout)
        return found[-1] if found else GroupVerdict.TIMEOUT

    def remaining_bytes(self, first_page: int) -> int:
        """Bytes of pages ``>= first_page`` still to land (a failed page has nothing more to land)."""
        with self._cond:
            return sum(self._tail_bytes[self._done[p]] for p in range(max(0, first_page), self.pages)
                       if self._failed[p] is None)

    def read_rate(self) -> float | None:
        """Verified bytes landed per second (None before the first landing): since the first landing once more
        landed after it, else since the thread began (that span also holds the thread's start and the read's
        set-up, which the rest of the read does not repeat). Counted to now, so a stalled read's rate falls
        while it lands nothing."""
        with self._cond:
            if self._first_at is None or self._began is None:
                return None
            now = self._clock()
            if self._bytes > self._first_bytes and now > self._first_at:
                return (self._bytes - self._first_bytes) / (now - self._first_at)
            elapsed = now - self._began
            return self._bytes / elapsed if elapsed > 0 else None

    def rate_settled(self) -> bool:
        """``read_rate`` counts between landings: a second landing came after the first."""
        with self._cond:
            return self._first_at is not None and self._bytes > self._first_bytes

    def cancel(self) -> None:
        with self._cond:
            if self._ended or self._cancelled:
                return
            self._cancelled = True
            self._fail_unlanded()
            ended_now = not self._running  # queued or never started: the thread will do nothing
            if ended_now:
                self._end_locked()
        if ended_now:
            self._report()

    @property
    def ended(self) -> bool:
        with self._cond:
            return self._ended

    def wait_ended(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._ended, timeout)

    # ------------------------------------------------------------------ for the binder
    @property
    def cancelled(self) -> bool:
        with self._cond:
            return self._cancelled

    def page_settled(self, page: int) -> bool:
        """Whether this stream writes ``page``'s slots no more (landed whole, stopped by the store, or ended)."""
        with self._cond:
            return self._ended or self._settled[page]

    def summary(self) -> StreamSummary:
        with self._cond:
            g = self.groups
            failed = [f for f in self._failed if f is not None]
            landed = sum(d == g for d in self._done)
            return StreamSummary(self.pages, landed, self._staged, len(failed), g - min(failed) if failed else 0,
                                 self._cancelled, self._error)

    def start(self) -> None:
        """Queue the stream's thread on the executor (once); a refused submit ends it, every group FAILED."""
        with self._cond:
            if self._started or self._cancelled:
                return
            self._started = True
        try:
            self._executor.submit(self._run)
        except RuntimeError as exc:  # the executor is shut down (the binder is closing)
            self._boundary.fail("tail stream start", exc, outcome="its pages failed")
            with self._cond:
                self._error = True
                self._fail_unlanded()
                self._end_locked()
            self._report()

    # ------------------------------------------------------------------ the stream's thread
    def _run(self) -> None:
        with self._cond:
            if self._cancelled:  # cancelled while queued: ``cancel`` ended it already
                return
            self._running = True
            self._began = self._clock()
        readahead = self._tier.readahead
        try:
            runs = self._tier.pages.page_runs(self._slots)
            if readahead is not None:
                self._pending = readahead.take(self.keys, self._wake)
                self._staged = len(self._pending)
            staged = set(self._pending)
            # Staged pages already read first: they are typically the hit's leading pages (read-ahead stages
            # a span front to back), the head SGLang asks for first.
            self._copy_staged(runs)
            rest = [p for p in range(self.pages) if p not in staged]
            if rest:
                self._read(rest, runs)
            while self._pending:
                with self._cond:
                    self._cond.wait_for(lambda: self._cancelled or any(e.done.is_set() for e in self._pending.values()))
                self._check_cancelled()
                self._copy_staged(runs)
            if self._fallback:
                self._read(sorted(self._fallback), runs)
        except _Cancelled:
            pass
        except Exception as exc:  # thread boundary: a failed stream is FAILED groups, never an exception
            with self._cond:
                self._error = True
            self._boundary.fail("tail stream", exc, outcome="its pages not landed failed")
        finally:
            if readahead is not None:
                for entry in self._pending.values():
                    readahead.give_back(entry)
            self._pending = {}
            with self._cond:
                self._fail_unlanded()
                self._end_locked()
            self._report()

    def _read(self, pages: list[int], runs: list[list[Run]]) -> None:
        ps = self.page_tokens
        slots = torch.cat([self._slots[p * ps:(p + 1) * ps] for p in pages])

        def on_group(group: int, layers: range, ok: list[bool]) -> None:
            self._record_group(pages, group, ok)
            self._copy_staged(runs)  # staged reads that ended meanwhile, while group + 1 is in flight
            if self._observer is not None:
                self._observer(self, group)
            self._check_cancelled()  # before drive starts group + 2: a cancel seen here stops all new IO

        read_layer_groups(self._tier, [self.keys[p] for p in pages], slots, on_group, self._plan)

    def _record_group(self, pages: list[int], group: int, ok: list[bool]) -> None:
        with self._cond:
            if self._cancelled:  # every unlanded group is FAILED already; nothing lands after a cancel
                raise _Cancelled
            last = group + 1 == self.groups
            for i, page in enumerate(pages):
                failed_in = self._failed_in[page]
                if failed_in is not None:
                    # Crash-ordering of slot reuse: the read group sent beside the one a page failed in may
                    # still write its slots (part_reads), so the page settles, and its slots may be handed
                    # back (binding.claim_released), only once the group after the failing one has landed.
                    self._settled[page] = self._settled[page] or failed_in < group
                    continue
                if self._failed[page] is not None or self._done[page] > group:
                    continue
                if ok[i]:
                    self._done[page] = group + 1
                    self._bytes += self._group_bytes[group]
                    self._settled[page] = last
                else:  # failed: nothing in its slots is used from here on
                    self._failed[page] = self._done[page]
                    self._failed_in[page] = group
                    self._settled[page] = last
            self._landed_locked()

    def _copy_staged(self, runs: list[list[Run]]) -> None:
        """Copy every taken staged page whose read ended (stream thread only)."""
        readahead = self._tier.readahead
        for page in [p for p, e in self._pending.items() if e.done.is_set()]:
            self._check_cancelled()  # no copy starts after a cancel
            entry = self._pending.pop(page)
            if readahead is None or not self._deliver(readahead, entry, runs[page]):
                self._fallback.append(page)
                continue
            with self._cond:
                if self._failed[page] is None:
                    self._bytes += self._tail_bytes[self._done[page]]
                    self._done[page] = self.groups
                self._settled[page] = True
                self._landed_locked()

    @staticmethod
    def _deliver(readahead: ReadAhead, entry: StagedPage, runs: list[Run]) -> bool:
        try:
            return readahead.deliver(entry, runs)
        except BaseException:
            readahead.give_back(entry)  # its buffer back to the staging area, whatever the copy raised
            raise

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _check_cancelled(self) -> None:
        with self._cond:
            if self._cancelled:
                raise _Cancelled

    # ------------------------------------------------------------------ under the condition
    def _verdict(self, group: int, first: int) -> GroupVerdict | None:
        waiting = False
        for page in range(first, self.pages):
            if self._done[page] > group:
                continue
            if self._failed[page] is not None:  # failed at done[page] <= group
                return GroupVerdict.FAILED
            waiting = True
        return None if waiting else GroupVerdict.LANDED

    def _landed_locked(self) -> None:
        if self._bytes and self._first_at is None:
            self._first_at, self._first_bytes = self._clock(), self._bytes
        while self._landed < self.pages and self._done[self._landed] == self.groups:
            self._landed += 1
        self._cond.notify_all()

    def _fail_unlanded(self) -> None:
        for page in range(self.pages):
            if self._failed[page] is None and self._done[page] < self.groups:
                self._failed[page] = self._done[page]
        self._cond.notify_all()

    def _end_locked(self) -> None:
        self._settled = [True] * self.pages
        self._ended = True
        self._cond.notify_all()

    def _report(self) -> None:
        with self._cond:
            if self._reported:
                return
            self._reported = True
        if self._on_end is not None:
            try:
                self._on_end(self)
            except Exception as exc:  # bookkeeping only: never into SGLang's or the stream's thread
                self._boundary.fail("tail stream end", exc, outcome="not counted")


if TYPE_CHECKING:  # mypy: the class implements the contract's protocol
    _conforms: type[contract.TailStream] = TailStream
