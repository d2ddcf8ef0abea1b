"""PageIO: moves whole pages between caller memory and device slots, many IOs in flight, verified.

One vectored IO per page: the caller's runs straight to the slot with O_DIRECT when aligned, else through a
bounce buffer (one memcpy). It skips devices whose circuit is open, feeds the breakers, and fdatasyncs the
data files of a write batch unless durability is ``none``. It knows slots, not the index.

Writes (``store.format``, "Slot"): ONE IO per page covering its whole slot: the page, its trailer
(``format.pack_trailer``, with each part's xxh3-64, ``store.parts``) at ``page_bytes``, zeros to
``slot_bytes``; so a torn write leaves a trailer whose checksums the page fails, and ``admin.rebuild``
skips it. Only a PageIO given a ``SlotIdentity`` (the writer's) writes.
Checksums are taken by the engine inside each page's IO (``io.ops`` range digests): a write op names the
page's parts as ``digest_ranges`` and its ``before_write`` packs the trailer from their digests before any
byte is sent, so the checksums the journal records (``IOResult.part_digests``) are the trailer's. Reads move
the page's bytes only (not the trailer), verified against the checksums the index recorded; a page is a
hit only if every part passes. Group-major reads are ``store.part_reads``, on ``locate``/``submit``.

Each page read gets a ``ReadVerdict``; only ``HIT`` leaves bytes in the caller's runs that it may use.
A peer follower's PageIO carries a ``renewal`` (``store.renewal``): a page failing verification, or whose
read failed through a lost descriptor (``renewable``, ``store.lost_handles``), is read once more where its
segment's descriptor was just renewed (``fresh_retry``), and is a hit only if it verifies then.
``read_timed`` also reports each device's busy time in the batch from its own ops (``busy_seconds``), so a
slow device shows up as slow even when a fast one shares the batch.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from sgl_kvtier.errors import KVTierError, StoreClosedError, StoreFormatError
from sgl_kvtier.io.buffers import (
    ALIGN,
    AlignedBuffer,
    BouncePool,
    Run,
    copy_runs_to,
    copy_to_runs,
    round_up,
    runs_aligned,
    view,
)
from sgl_kvtier.io.engine import IOEngine, IOOp, IOResult, OpKind
from sgl_kvtier.io.threads import io_thread_started
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.devices import Arena
from sgl_kvtier.store.health import DeviceHealth
from sgl_kvtier.store.layout import Layout
from sgl_kvtier.store.lifecycle import release_all
from sgl_kvtier.store.lost_handles import handle_lost
from sgl_kvtier.store.parts import Checksum, PartMap, pack_sums
from sgl_kvtier.store.renewal import DescriptorRenewal
from sgl_kvtier.telemetry.counters import RateLimitedLog, StoreCounters

log = logging.getLogger(__name__)

# (caller's runs, global slot, key, parent key or None, seq of the write)
WriteItem = tuple[Sequence[Run], int, bytes, bytes | None, int]
ReadItem = tuple[Sequence[Run], tuple[int, Checksum]]  # (caller's runs, (slot, checksums recorded at write))
PART_READ_THREADS = 4  # a shard's threads running group-major reads' batches (``submit``)
_T = TypeVar("_T")


@dataclass(frozen=True)
class SlotIdentity:
    """Who writes a slot, as its trailer names it: the namespace digest and the writer's incarnation
    (16 bytes each; the incarnation is new per open of a writer)."""

    ns_digest: bytes
    incarnation: bytes

    def __post_init__(self) -> None:
        if len(self.ns_digest) != 16 or len(self.incarnation) != 16:
            raise ValueError("SlotIdentity: ns_digest and incarnation are 16 bytes each")


class ReadVerdict(enum.Enum):
    """What reading one page found (only ``HIT`` leaves usable bytes in the caller's runs)."""

    HIT = "hit"  # the page's bytes, verified against its checksum, are in the caller's runs
    CORRUPT = "corrupt"  # short or failing its checksum: torn, stale or damaged; the caller drops the page
    IO_ERROR = "io_error"  # the read failed; the page may be fine and is kept (a miss this time)
    SKIPPED = "skipped"  # the device's circuit breaker is open: no IO was sent (a miss)


class PageIO:
    """Vectored, verified page IO between caller runs and device slots (see the module docstring)."""

    def __init__(self, layout: Layout, engine: IOEngine, health: DeviceHealth, counters: StoreCounters,
                 page_bytes: int, io_depth: int, sync_writes: bool, on_device_full: Callable[[int], None],
                 *, identity: SlotIdentity | None = None, parts: Sequence[int] | None = None):
        """``identity``: the writer's (its pages' trailers name it); None for a reader, whose ``write`` raises.
        ``parts``: the byte length of each checksummed part of a page (None: one part, the whole page).

        Raises StoreFormatError when a writer's slots leave no room for the trailer after the page,
        ValueError when ``parts`` do not add up to the page."""
        self.layout = layout
        self.engine = engine
        self.health = health
        self.counters = counters
        self.page_bytes = page_bytes
        self.slot_bytes = layout.slot_bytes
        self.identity = identity
        self.parts = PartMap.of(parts or [page_bytes])
        if self.parts.page_bytes != page_bytes:
            raise ValueError(f"parts {list(self.parts.sizes)} do not add up to the page's {page_bytes} bytes")
        self._one_part = self.parts.count == 1
        self._ranges = tuple(zip(self.parts.offsets, self.parts.sizes))  # each part's (offset, size) in a page
        self._tail = self.slot_bytes - page_bytes  # the bytes after the page: trailer, then zeros
        need = fmt.trailer_bytes(self.parts.count)
        if identity is not None and self._tail < need:
            raise StoreFormatError(
                f"slots of {self.slot_bytes} bytes leave {self._tail} after a {page_bytes}-byte page, a slot "
                f"trailer needs {need}: format {fmt.FORMAT_VERSION} slots are "
                f"{fmt.slot_bytes_for(page_bytes, self.parts.count)} bytes (format.slot_bytes_for)")
        self._zeros = memoryview(bytes(max(self._tail, 0)))
        self._ndev = len(layout.arenas)
        self._bounce = BouncePool(self.slot_bytes, io_depth)
        # One slab holds the tails (trailer + zeros) of a chunk of aligned pages; made lazily, so a reader,
        # which never writes, costs nothing.
        self._tails_per_slab = max(64, 2 * max(1, io_depth))
        self._tails = BouncePool(max(self._tail, 1) * self._tails_per_slab, 4)
        self._depth = max(1, io_depth)  # the engine's IOs in flight (it is built with the same depth)
        self._sync_writes = sync_writes
        self._on_device_full = on_device_full
        self._errlog = RateLimitedLog(log)
        self._part_threads: ThreadPoolExecutor | None = None  # made by the first ``submit``
        self.renewal: DescriptorRenewal | None = None  # a peer follower's (``store.renewal``): see ``fresh_retry``
        self._threads_lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """End the part-read threads (a batch in flight finishes first), close the engine (its threads or
        rings end here) and free the bounce buffers, each whatever the others raised (then the first error)."""
        with self._threads_lock:
            threads, self._part_threads, self._closed = self._part_threads, None, True
        steps: list[tuple[str, Callable[[], object]]] = [] if threads is None else [
            ("part read threads", threads.shutdown)]
        release_all([*steps, ("io engine", self.engine.close), ("bounce buffers", self._bounce.close),
                     ("trailer slabs", self._tails.close)])

    @property
    def devices(self) -> int:
        """How many devices the slots stripe over."""
        return self._ndev

    @property
    def depth(self) -> int:
        """The engine's IOs in flight per batch."""
        return self._depth

    @property
    def bounces(self) -> BouncePool:
        """The bounce buffers (``slot_bytes`` each) for IO that O_DIRECT cannot do in caller memory."""
        return self._bounce

    def locate(self, slot: int) -> tuple[int, int]:
        """(fd, byte offset) of a global slot. Raises OSError where its segment cannot be opened or made."""
        return self._arena(slot).locate(slot // self._ndev)

    def fresh_retry(self, slots: Sequence[int]) -> set[int]:
        """Of ``slots``, whose pages just failed verification, those to read once more: their segment's
        descriptor was renewed now (``store.renewal``). Empty without a renewal (a writer's PageIO, an
        offline reader's) and for an empty ``slots``."""
        if self.renewal is None or not slots:
            return set()
        return self.renewal.renew(slots)

    def submit(self, task: Callable[[], _T]) -> Future[_T]:
        """Run ``task`` on this PageIO's part-read threads (``PART_READ_THREADS``, made on first use).
        Raises StoreClosedError once the PageIO is closed."""
        with self._threads_lock:
            if self._closed:
                raise StoreClosedError("page store is closed")
            if self._part_threads is None:
                self._part_threads = ThreadPoolExecutor(PART_READ_THREADS, thread_name_prefix="kvtier-parts",
                                                        initializer=io_thread_started)
            return self._part_threads.submit(task)

    def write(self, items: list[WriteItem]) -> list[Checksum | None]:
        """Write pages, each with its trailer, to their slots (one IO per slot, see the module docstring);
        the checksums of each written page (``store.parts.Checksum``), or None where it failed.

        Raises KVTierError on a PageIO without a ``SlotIdentity`` (a reader's)."""
        if self.identity is None:
            raise KVTierError("this PageIO has no writer identity (a reader's): it cannot write pages")
        sums: list[Checksum | None] = [None] * len(items)
        bounced = [self._needs_bounce(item[0]) for item in items]
        step = self._bounce.count if any(bounced) else self._tails_per_slab
        for start in range(0, len(items), step):
            chunk = range(start, min(start + step, len(items)))
            # Bounce buffers first, then the slab: one order for every thread, so none holds a slab while
            # waiting for bounce buffers another holds while waiting for a slab.
            spare = self._take_bounces([items[j][0] for j in chunk])
            slab = self._tails.acquire() if not all(bounced[j] for j in chunk) else None
            try:
                self._write_chunk(items, chunk, bounced, spare, slab, sums)
            finally:
                self._give_back(spare)
                if slab is not None:
                    self._tails.release(slab)
        return sums

    def _write_chunk(self, items: list[WriteItem], chunk: range, bounced: list[bool], spare: list[AlignedBuffer],
                     slab: AlignedBuffer | None, sums: list[Checksum | None]) -> None:
        ops: list[IOOp] = []
        placed: list[int] = []  # the item index of each op
        tails = bounces = 0  # used so far of the slab's tails and of ``spare`` (all given back by the caller)
        for j in chunk:
            runs, slot = items[j][0], items[j][1]
            if not self.health.usable(slot % self._ndev):
                continue  # the device's circuit is open: fail fast, no IO
            try:
                fd, offset = self._arena(slot).locate(slot // self._ndev)
            except OSError as exc:  # a segment could not be created: the device is full
                self._device_full(slot, exc)
                continue
            if bounced[j]:
                bounce = spare[bounces]
                bounces += 1
                copy_runs_to(bounce.view, runs)
                tail = bounce.view[self.page_bytes:self.slot_bytes]
                buffers = [bounce.view[:self.slot_bytes]]
            else:
                assert slab is not None
                tail = slab.view[tails * self._tail:(tails + 1) * self._tail]
                tails += 1
                buffers = [view(a, n) for a, n in runs]
                buffers.append(tail)
            # The engine digests the page's parts, then (still before the IO) fills the tail from them.
            ops.append(IOOp(OpKind.WRITE, fd, offset, buffers, checksum=False, device=slot % self._ndev,
                            digest_ranges=self._ranges, before_write=partial(self._put_tail, tail, items[j])))
            placed.append(j)
        results = self._run(ops)
        for j, res, op in zip(placed, results, ops):
            self.health.record(op.device, res.ok, res.seconds)
            got = res.part_digests
            if res.ok and got is not None and len(got) == self.parts.count:
                sums[j] = pack_sums(got)
            elif res.ok:  # an engine that ignored the ranges: the trailer was not made, the page is not kept
                self.counters.io_errors += 1
                self._errlog.error("write to %s: engine %s returned no part checksums", self._arena(items[j][1]).path,
                                   self.engine.name)
            else:
                self.counters.io_errors += 1
                self._errlog.error("write to %s failed: %s", self._arena(items[j][1]).path, res.error)
        if self._sync_writes:
            self._sync_data({op.fd for op, res in zip(ops, results) if res.ok})

    def _put_tail(self, tail: memoryview, item: WriteItem, part_sums: list[int]) -> None:
        """Fill a slot's bytes after the page: the page's trailer, then zeros (the buffer is reused). The
        page op's ``before_write``: called by the engine, on its IO thread, with the parts' digests."""
        assert self.identity is not None
        _, _, key, parent, seq = item
        trailer = fmt.pack_trailer(self.identity.ns_digest, key, parent, self.identity.incarnation, seq, part_sums)
        n = len(trailer)
        tail[:n] = trailer
        tail[n:] = self._zeros[n:]

    def _device_full(self, slot: int, exc: OSError) -> None:
        self.counters.io_errors += 1
        self._errlog.error("%s: cannot grow (%s); capacity is now %d pages", self._arena(slot).path,
                           exc.strerror, slot)
        self._on_device_full(slot)

    def _arena(self, slot: int) -> Arena:
        return self.layout.arenas[slot % self._ndev]

    def _needs_bounce_any(self, pages: Sequence[Sequence[Run]]) -> bool:
        return any(self._needs_bounce(runs) for runs in pages)

    def _needs_bounce(self, runs: Sequence[Run]) -> bool:
        """O_DIRECT needs aligned memory and lengths: a page of another shape goes through a bounce buffer."""
        return self.layout.direct and (self.page_bytes % ALIGN != 0 or not runs_aligned(runs, ALIGN))

    def _take_bounces(self, pages: Sequence[Sequence[Run]]) -> list[AlignedBuffer]:
        """Every bounce buffer a chunk (at most the pool's size) needs, taken at once: taking them one by one,
        two threads' chunks could each hold part of the pool and wait for the rest forever."""
        return self._bounce.acquire_many(sum(self._needs_bounce(runs) for runs in pages))

    def _give_back(self, spare: list[AlignedBuffer]) -> None:
        for buf in spare:  # taken for pages that did no IO (an open circuit, a segment not created)
            self._bounce.release(buf)
        spare.clear()

    def _read_op(self, slot: int, runs: Sequence[Run], spare: list[AlignedBuffer]) -> tuple[IOOp, AlignedBuffer | None]:
        """The read of one page (its bytes only, not the trailer); one that needs a bounce buffer takes one
        of ``spare`` and reads the page rounded up to the alignment."""
        fd, offset = self._arena(slot).locate(slot // self._ndev)
        if not self._needs_bounce(runs):  # one part: the op's digest (the fast path); several: one per part
            return IOOp(OpKind.READ, fd, offset, [view(a, n) for a, n in runs], checksum=self._one_part,
                        device=slot % self._ndev, digest_ranges=None if self._one_part else self._ranges), None
        bounce = spare.pop()
        length = round_up(self.page_bytes)
        return IOOp(OpKind.READ, fd, offset, [bounce.view[:length]], checksum=False, device=slot % self._ndev,
                    digest_ranges=self._ranges), bounce

    def _run(self, ops: list[IOOp]) -> list[IOResult]:
        return self.engine.run(ops)

    def _sync_data(self, fds: set[int]) -> None:
        for fd in fds:
            try:
                os.fdatasync(fd)
            except OSError as exc:
                self.counters.io_errors += 1
                self._errlog.error("fdatasync failed: %s", exc)

    def read(self, items: list[ReadItem]) -> list[ReadVerdict]:
        """Read pages into their runs; a ``ReadVerdict`` per page."""
        return self.read_timed(items)[0]

    def read_timed(self, items: list[ReadItem]) -> tuple[list[ReadVerdict], list[float]]:
        """``read``'s verdicts, and per device the seconds it was busy with this batch (0.0: no measured op)."""
        verdicts = [ReadVerdict.SKIPPED] * len(items)
        busy = [0.0] * self._ndev
        direct = not self._needs_bounce_any([runs for runs, _ in items])
        step = len(items) if direct else max(1, self._bounce.count)
        for start in range(0, len(items), step):
            placed: list[tuple[int, IOOp, AlignedBuffer | None]] = []  # (item index, op, bounce)
            chunk = range(start, min(start + step, len(items)))
            spare = self._take_bounces([items[j][0] for j in chunk])
            for j in chunk:
                runs, (slot, _) = items[j]
                if not self.health.usable(slot % self._ndev):
                    continue  # the device's circuit is open: a miss, SGLang recomputes
                try:
                    op, bounce = self._read_op(slot, runs, spare)
                except OSError as exc:
                    self.counters.io_errors += 1
                    self._errlog.error("read of slot %d: %s", slot, exc)
                    verdicts[j] = ReadVerdict.IO_ERROR
                    continue
                placed.append((j, op, bounce))
            results = self._run([op for _, op, _ in placed])
            for (j, _, bounce), res in zip(placed, results):
                verdicts[j] = self._verdict(res, bounce, items[j])
            retry = [n for n, ((j, _, _), res) in enumerate(zip(placed, results)) if renewable(verdicts[j], res)]
            redo = self.fresh_retry([items[placed[n][0]][1][0] for n in retry])
            renewed = [n for n in retry if items[placed[n][0]][1][0] in redo]
            for n, ((_, op, _), res) in enumerate(zip(placed, results)):
                if res.ok or n not in renewed:  # a read failed through a lost descriptor: its re-read answers
                    self.health.record(op.device, res.ok or res.short, res.seconds)
            again = [placed[n] for n in renewed]
            for (j, op, bounce), res in zip(again, self._run([op for _, op, _ in again]) if again else []):
                self.health.record(op.device, res.ok or res.short, res.seconds)
                verdicts[j] = self._verdict(res, bounce, items[j])
                self.counters.fresh_rereads += verdicts[j] is ReadVerdict.HIT
            for _, _, bounce in placed:
                if bounce is not None:
                    self._bounce.release(bounce)
            self._give_back(spare)
            # Steps run one after another, so a device's busy time over the batch is the sum over steps.
            step_busy = busy_seconds([(op.device, res.seconds) for (_, op, _), res in zip(placed, results)],
                                     self._ndev, self._depth)
            busy = [a + b for a, b in zip(busy, step_busy)]
        return verdicts, busy

    def _verdict(self, res: IOResult, bounce: AlignedBuffer | None, item: ReadItem) -> ReadVerdict:
        runs, (_, checksum) = item
        if res.short:
            return ReadVerdict.CORRUPT
        if not res.ok:
            self.counters.io_errors += 1
            self._errlog.error("read failed: %s", res.error)
            return ReadVerdict.IO_ERROR
        got: Checksum | None
        if self._one_part and bounce is None:
            got = res.checksum
        elif res.part_digests is not None:
            got = pack_sums(res.part_digests)
        else:  # an engine that ignored the ranges: the parts hashed here, after the batch
            got = pack_sums(self.parts.run_digests(runs) if bounce is None else self.parts.buffer_digests(bounce.view))
        if got != checksum:
            return ReadVerdict.CORRUPT
        if bounce is not None:
            copy_to_runs(bounce.view, runs)
        return ReadVerdict.HIT


def renewable(verdict: ReadVerdict, res: IOResult) -> bool:
    """Whether a page read is worth once more through a fresh descriptor (``PageIO.fresh_retry``): it failed
    verification (stale bytes), or its IO failed through a descriptor that is lost for good
    (``store.lost_handles``: the filesystem's client died and was mounted again)."""
    return verdict is ReadVerdict.CORRUPT or (verdict is ReadVerdict.IO_ERROR and handle_lost(res.error))


def busy_seconds(op_seconds: Sequence[tuple[int, float]], ndev: int, depth: int) -> list[float]:
    """Each device's busy time during one engine run, from its own ops' ``(device, seconds)``.

    The engine ran the ``N`` ops with at most ``depth`` in flight. A device with ``n`` of them is taken to
    have held its share of those slots, ``min(n, depth * n / N)`` on average, so its ops spanned
    ``sum(seconds) / share``, and never less than its slowest op. With ``N <= depth`` (all in flight at
    once) that is the slowest op. A device without ops, or whose engine measures nothing, gets 0.0.
    """
    total = len(op_seconds)
    count, summed, longest = [0] * ndev, [0.0] * ndev, [0.0] * ndev
    for d, s in op_seconds:
        if 0 <= d < ndev:
            count[d] += 1
            summed[d] += max(s, 0.0)
            longest[d] = max(longest[d], s)
    return [0.0 if summed[d] <= 0 else max(longest[d], summed[d] / min(n, depth * n / total))
            for d, n in enumerate(count)]
