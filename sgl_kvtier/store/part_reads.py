"""Group-major reads of a batch of pages: part group 0 of every page, verified and handed over, then group 1...

``PageShard.get_parts`` and ``SharedPool.get_parts`` (parts and groups: ``store.parts``) make one
``PartRead`` per shard holding pages of the batch (``PageShard.part_read``) and run them in lock step
(``drive``):

    start(0) on every shard; then for each group g:
        start(g + 1) on every shard  sent at once, on a part-read thread, for the pages still hits, so the
                                     device has g + 1's IO queued behind g's and never idles between groups
        finish(g) on every shard     wait for g's IO: a page whose parts of g all verified stays a hit
        on_part(g, ok)               the caller's work on group g while g + 1 is read
    close() on every shard           (also when on_part raises) wait for the IO in flight, unpin, settle

Order: a group hands its IO to the engine only after the group before it did (``_take_turn``; after
``TURN_WAIT_S`` it goes anyway: order is a speed rule, never a wait without end). At most two groups are in
flight; a page failing a part in group g gets no IO from g + 2 on; an error raised by ``on_part`` stops
every later group. IO: one op per (page, span of consecutive parts of a group), a ``preadv`` straight into
the runs covering them (``PartMap.split``), each part checked against its own xxh3-64; with O_DIRECT a part
not 4 KiB aligned (offset, length or runs) is a span of its own, read through a bounce buffer.

Safety, as ``get``'s: every page's slot is pinned from ``PageShard.part_read`` until ``close``, and ``close``
waits for every task in flight before anything is unpinned, so no IO lands in caller memory after
``get_parts`` returns or raises. Verdicts: a part short or failing its checksum makes its page ``CORRUPT``;
a failed IO ``IO_ERROR``, an open breaker or a page not read whole ``SKIPPED`` (misses, the page kept).
The read's seconds are the wall time with a group in flight (overlaps counted once); each device's busy
time is scaled by the same factor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from functools import partial

from sgl_kvtier.io.buffers import ALIGN, AlignedBuffer, Run, copy_to_runs, round_up, runs_aligned, view
from sgl_kvtier.io.engine import IOOp, IOResult, OpKind, digest, range_digests
from sgl_kvtier.store.lifecycle import Failure, Step, release_all, run_steps
from sgl_kvtier.store.parts import Checksum, part_sum
from sgl_kvtier.store.transfer import PageIO, ReadVerdict, busy_seconds, renewable
from sgl_kvtier.telemetry.counters import RateLimitedLog

log = logging.getLogger(__name__)
TURN_WAIT_S = 1.0  # longest a group waits for the group before it to hand its IO over (module docstring)
OnPart = Callable[[int, list[bool]], None]  # (group, per page of the batch: all its groups so far verified)
PartItem = tuple[int, Sequence[Run], tuple[int, Checksum]]  # (position in the batch, runs, (slot, checksums))
Release = Callable[[list[ReadVerdict], float, list[float]], None]  # (verdicts, IO seconds, busy s per device)
Span = tuple[int, ...]  # consecutive part indices of one group, read by one op
_Placed = tuple[int, Span, IOOp, AlignedBuffer | None, int]  # (item, span, op, bounce, part's offset in it)


@dataclass
class _Group:
    """What one group's IO found (made on a part-read thread, applied on the caller's by ``finish``)."""

    failed: dict[int, ReadVerdict] = field(default_factory=dict)  # item -> why it is no longer a hit
    parts_read: int = 0
    parts_failed: int = 0
    io_errors: int = 0
    fresh: int = 0  # ops that verified once read again through a renewed descriptor (``store.renewal``)
    index: int = 0  # which read group of the plan
    began: float = 0.0  # perf_counter when its task began
    seconds: float = 0.0
    busy: list[float] = field(default_factory=list)

    def fail(self, item: int, verdict: ReadVerdict) -> None:
        if self.failed.get(item) is not ReadVerdict.CORRUPT:  # one corrupt part makes the page corrupt
            self.failed[item] = verdict


class PartRead:
    """One shard's share of a group-major read batch (see the module docstring); ``close`` it always."""

    def __init__(self, io: PageIO, items: list[PartItem], plan: list[tuple[int, ...]], release: Release):
        """``items``: the pinned pages; ``plan``: the groups (``PartMap.plan``); ``release``: called once by
        ``close`` with the verdicts, the IO seconds and each device's busy seconds (unpins, settles)."""
        self._io = io
        self._items = items
        self._plan = plan
        self._release = release
        self._pieces = [io.parts.split(runs) for _, runs, _ in items]  # per item, per part: its runs
        self.verdicts = [ReadVerdict.HIT] * len(items)
        self._turns = [threading.Event() for _ in plan]  # set once group g handed its IO over (or has none)
        self._outstanding: deque[Future[_Group]] = deque()  # groups sent and not landed, in order
        self._finished = 0  # groups landed
        self._seconds = 0.0  # wall seconds with a group of this read in flight (overlaps counted once)
        self._covered = 0.0  # perf_counter up to which ``_seconds`` counts
        self._group_seconds = 0.0  # the groups' own seconds, summed (overlaps twice)
        self._busy = [0.0] * io.devices
        self._closed = False
        self._errlog = RateLimitedLog(log)

    def start(self, group: int) -> None:
        """Send group ``group``'s IO for the pages still hits (as landed so far), on a part-read thread."""
        alive = [k for k, v in enumerate(self.verdicts) if v is ReadVerdict.HIT]
        self._outstanding.append(self._io.submit(partial(self._read_group, group, alive)))

    def finish(self, ok: list[bool]) -> None:
        """Wait for the oldest group not landed; set ``ok[position]`` of each of this shard's pages that is
        still a hit (every part of every group so far verified in its runs)."""
        self._land()
        self._finished += 1
        for (position, _, _), verdict in zip(self._items, self.verdicts):
            ok[position] = verdict is ReadVerdict.HIT

    def close(self) -> None:
        """Wait for the IO in flight, then hand the verdicts to ``release`` (idempotent). Raises what a
        group's read raised, once nothing is in flight."""
        if self._closed:
            return
        self._closed = True
        for fut in self._outstanding:
            fut.cancel()  # a group not begun on its thread yet: no IO
        error: BaseException | None = None
        try:
            while self._outstanding:
                try:
                    self._land()
                except CancelledError:
                    pass
                except BaseException as exc:  # noqa: B036 - raised below, after every group in flight ended
                    error = error or exc
        finally:
            if self._finished < len(self._plan):  # left early: a page not read whole is a miss (kept)
                self.verdicts = [ReadVerdict.SKIPPED if v is ReadVerdict.HIT else v for v in self.verdicts]
            # Two groups overlap in flight: each device's busy time, summed over groups, is scaled to the
            # wall time they covered (a device is never busier than the read was in flight).
            scale = min(1.0, self._seconds / self._group_seconds) if self._group_seconds > 0 else 1.0
            self._release(self.verdicts, self._seconds, [b * scale for b in self._busy])
        if error is not None:
            raise error

    def _land(self) -> None:
        """Wait for the oldest outstanding group and apply what it found (caller's thread)."""
        if not self._outstanding:
            return
        group = self._outstanding.popleft().result()
        for k, verdict in group.failed.items():
            self.verdicts[k] = verdict
        counters = self._io.counters
        counters.parts_read += group.parts_read
        counters.parts_failed += group.parts_failed
        counters.io_errors += group.io_errors
        counters.fresh_rereads += group.fresh
        ended = group.began + group.seconds
        self._seconds += max(0.0, ended - max(group.began, self._covered))  # landed in the order sent
        self._covered = max(self._covered, ended)
        self._group_seconds += group.seconds
        self._busy = [a + b for a, b in zip(self._busy, group.busy)]

    # ------------------------------------------------------------------ on a part-read thread
    def _read_group(self, index: int, alive: list[int]) -> _Group:
        io, parts = self._io, self._plan[index]
        started = time.perf_counter()
        group = _Group(index=index, began=started, busy=[0.0] * io.devices)
        chunk: list[tuple[int, Span, bool]] = []  # (item, parts, through a bounce buffer)
        bounced = 0
        try:
            for k in alive:
                if not io.health.usable(self._items[k][2][0] % io.devices):
                    group.fail(k, ReadVerdict.SKIPPED)  # its device's circuit is open: no IO
                    continue
                for span, bounce in self._spans(k, parts):
                    if bounce and bounced == io.bounces.count:
                        self._run_chunk(chunk, bounced, group)
                        chunk, bounced = [], 0
                    chunk.append((k, span, bounce))
                    bounced += bounce
            if chunk:
                self._run_chunk(chunk, bounced, group)
        finally:
            self._turns[index].set()  # no IO (left), or all of it handed over: the next group's turn
        group.seconds = time.perf_counter() - started
        return group

    def _take_turn(self, index: int) -> None:
        """Before group ``index`` hands its first IO to the engine: wait until the group before it did (module
        docstring, "Order"), then let the group after it go."""
        turn = self._turns[index]
        if turn.is_set():
            return
        if index > 0 and not self._turns[index - 1].wait(TURN_WAIT_S):
            log.warning("read group %d went before group %d handed its IO over", index, index - 1)
        turn.set()  # just before this group's ``engine.run``: the next one, its ops built, follows it in

    def _spans(self, k: int, parts: tuple[int, ...]) -> list[tuple[Span, bool]]:
        """Page ``k``'s ops for ``parts``: runs of consecutive parts read in place, one op each; a part that
        needs a bounce buffer alone (``True``)."""
        spans: list[tuple[Span, bool]] = []
        for p in sorted(parts):
            if self._needs_bounce(k, p):
                spans.append(((p,), True))
            elif spans and not spans[-1][1] and spans[-1][0][-1] + 1 == p:
                spans[-1] = (spans[-1][0] + (p,), False)
            else:
                spans.append(((p,), False))
        return spans

    def _needs_bounce(self, k: int, p: int) -> bool:
        parts = self._io.parts
        return self._io.layout.direct and (parts.offsets[p] % ALIGN != 0 or parts.sizes[p] % ALIGN != 0
                                           or not runs_aligned(self._pieces[k][p], ALIGN))

    def _run_chunk(self, chunk: list[tuple[int, Span, bool]], bounced: int, group: _Group) -> None:
        io = self._io
        if bounced:
            self._take_turn(group.index)  # before taking bounce buffers: a group waiting its turn holds none
        taken = io.bounces.acquire_many(bounced)  # all at once (``BouncePool``), all given back below
        try:
            spare = list(taken)
            placed: list[_Placed] = []
            for k, span, bounce in chunk:
                if k in group.failed:
                    continue  # an earlier chunk found the page bad: no more IO for it
                slot = self._items[k][2][0]
                try:
                    fd, base = io.locate(slot)
                except OSError as exc:
                    group.io_errors += 1
                    self._errlog.error("read of slot %d: %s", slot, exc)
                    group.fail(k, ReadVerdict.IO_ERROR)
                    continue
                at, device = io.parts.offsets[span[0]], slot % io.devices
                if bounce:  # one part
                    size = io.parts.sizes[span[0]]
                    buf, low = spare.pop(), at // ALIGN * ALIGN
                    op = IOOp(OpKind.READ, fd, base + low, [buf.view[:round_up(at + size) - low]], checksum=False,
                              device=device, digest_ranges=((at - low, size),), group=group.index)
                    placed.append((k, span, op, buf, at - low))
                else:
                    buffers = [view(a, n) for p in span for a, n in self._pieces[k][p]]
                    ranges = None if len(span) == 1 else tuple((io.parts.offsets[p] - at, io.parts.sizes[p])
                                                               for p in span)
                    op = IOOp(OpKind.READ, fd, base + at, buffers, checksum=ranges is None, device=device,
                              digest_ranges=ranges, group=group.index)
                    placed.append((k, span, op, None, 0))
            self._take_turn(group.index)  # its ops built: hand them over right after the group before did
            results = io.engine.run([op for _, _, op, _, _ in placed])
            found = [self._verdict(k, span, op, res, bounce_buf, skip, group)
                     for (k, span, op, bounce_buf, skip), res in zip(placed, results)]
            renewed = self._retry_fresh(placed, results, found, group)
            for n, ((_, _, op, _, _), res) in enumerate(zip(placed, results)):
                if res.ok or n not in renewed:  # a read failed through a lost descriptor: its re-read answered
                    io.health.record(op.device, res.ok or res.short, res.seconds)
            for (k, span, _, _, _), (verdict, good) in zip(placed, found):
                group.parts_read += good
                group.parts_failed += len(span) - good
                if verdict is not ReadVerdict.HIT:
                    group.fail(k, verdict)
            step = busy_seconds([(op.device, res.seconds) for (_, _, op, _, _), res in zip(placed, results)],
                                io.devices, io.depth)
            group.busy = [a + b for a, b in zip(group.busy, step)]
        finally:
            for taken_buf in taken:
                io.bounces.release(taken_buf)

    def _retry_fresh(self, placed: list[_Placed], results: list[IOResult], found: list[tuple[ReadVerdict, int]],
                     group: _Group) -> list[int]:
        """Read again the ops of ``placed`` that failed verification, or failed through a lost descriptor
        (``transfer.renewable``), where the page's segment descriptor was just renewed (``PageIO.fresh_retry``,
        ``store.renewal``); their new outcomes replace ``found``'s. Which ops of ``placed`` were read again."""
        bad = [n for n, ((verdict, _), res) in enumerate(zip(found, results)) if renewable(verdict, res)]
        redo = self._io.fresh_retry([self._items[placed[n][0]][2][0] for n in bad])
        again = [n for n in bad if self._items[placed[n][0]][2][0] in redo]
        if not again:
            return again
        for n, res in zip(again, self._io.engine.run([placed[n][2] for n in again])):
            k, span, op, bounce_buf, skip = placed[n]
            self._io.health.record(op.device, res.ok or res.short, res.seconds)
            found[n] = self._verdict(k, span, op, res, bounce_buf, skip, group)
            group.fresh += found[n][0] is ReadVerdict.HIT
        return again

    def _verdict(self, k: int, span: Span, op: IOOp, res: IOResult, buf: AlignedBuffer | None, skip: int,
                 group: _Group) -> tuple[ReadVerdict, int]:
        """What one op found for page ``k``, and how many of its parts verified."""
        if res.short:
            return ReadVerdict.CORRUPT, 0
        if not res.ok:
            group.io_errors += 1
            self._errlog.error("read failed: %s", res.error)
            return ReadVerdict.IO_ERROR, 0
        got: Sequence[int | None]
        if buf is not None:  # the engine's digest of the part's range in the bounce buffer (or, if it ignored it, ours)
            size = self._io.parts.sizes[span[0]]
            got = res.part_digests[:1] if res.part_digests else [digest([buf.view[skip:skip + size]])]
        elif op.digest_ranges is None:
            got = [res.checksum]
        else:  # several parts: each one's digest (the engine's, or ours if it ignored the ranges)
            got = res.part_digests if res.part_digests else range_digests(op.buffers, op.digest_ranges)
        sums = self._items[k][2][1]
        good = sum(1 for p, d in zip(span, got) if d == part_sum(sums, p))
        if good < len(span):
            return ReadVerdict.CORRUPT, good
        if buf is not None:
            copy_to_runs(buf.view[skip:skip + self._io.parts.sizes[span[0]]], self._pieces[k][span[0]])
        return ReadVerdict.HIT, good


def drive(reads: Sequence[PartRead], size: int, groups: int, on_part: OnPart) -> list[bool]:
    """Run ``reads`` (one per shard holding pages of a batch of ``size`` pages) in lock step over ``groups``
    groups, calling ``on_part(g, ok)`` after each (module docstring); returns the pages read whole. Every
    read is closed on the way out, also when ``on_part`` or a read raises (that error is the one raised)."""
    closes: list[Step] = [(f"part read {n}", read.close) for n, read in enumerate(reads)]
    done = [False] * size
    try:
        for read in reads:
            read.start(0)
        for g in range(groups):
            if g + 1 < groups:
                for read in reads:
                    read.start(g + 1)  # in flight beside g: the device never idles between groups
            ok = [False] * size
            for read in reads:
                read.finish(ok)
            done = list(ok)
            on_part(g, ok)
    except BaseException:
        _log_failed_closes(run_steps(closes))  # (their errors are kept in no frame of their tracebacks: no cycle)
        raise
    release_all(closes)
    return done


def _log_failed_closes(failures: list[Failure]) -> None:
    for step, exc in failures:
        log.warning("%s failed after an error of the read: %s", step, repr(exc))
