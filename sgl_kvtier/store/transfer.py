"""PageIO: moves whole pages between caller memory and device slots, many IOs in flight, verified.

It builds one vectored IO per page (the caller's runs straight to the slot with O_DIRECT when they are
aligned, else through a bounce buffer: one memcpy), skips devices whose circuit is open, feeds the
breakers, checksums every page (xxh3-64 taken before a write, checked after a read) and fdatasyncs the
data files of a write batch unless durability is ``none``. It knows slots, not keys or the index.

Each page read gets a ``ReadVerdict``: ``HIT`` (verified bytes are in the caller's runs), ``CORRUPT``
(short or failing its checksum: the caller drops the page), ``IO_ERROR`` (the IO failed; the page may
be fine and is kept) or ``SKIPPED`` (its device's circuit is open: no IO was sent). Only ``HIT`` puts
bytes in the caller's runs that it may use.

``read_timed`` also reports each device's busy time in the batch, estimated from that device's own ops
(``busy_seconds``), so a slow device shows up as slow even when a fast one shares the batch and its clock.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable, Sequence

from sgl_kvtier.io.buffers import ALIGN, AlignedBuffer, BouncePool, Run, copy_runs_to, copy_to_runs, runs_aligned, view
from sgl_kvtier.io.engine import IOEngine, IOOp, IOResult, OpKind, digest
from sgl_kvtier.store.devices import Arena
from sgl_kvtier.store.health import DeviceHealth
from sgl_kvtier.store.layout import Layout
from sgl_kvtier.store.lifecycle import release_all
from sgl_kvtier.telemetry.counters import RateLimitedLog, StoreCounters

log = logging.getLogger(__name__)

WriteItem = tuple[Sequence[Run], int]  # (caller's runs, slot)
ReadItem = tuple[Sequence[Run], tuple[int, int]]  # (caller's runs, (slot, checksum recorded at write))


class ReadVerdict(enum.Enum):
    """What reading one page found (only ``HIT`` leaves usable bytes in the caller's runs)."""

    HIT = "hit"  # the page's bytes, verified against its checksum, are in the caller's runs
    CORRUPT = "corrupt"  # short or failing its checksum: torn, stale or damaged; the caller drops the page
    IO_ERROR = "io_error"  # the read failed; the page may be fine and is kept (a miss this time)
    SKIPPED = "skipped"  # the device's circuit breaker is open: no IO was sent (a miss)


class PageIO:
    """Vectored, verified page IO between caller runs and device slots (see the module docstring)."""

    def __init__(self, layout: Layout, engine: IOEngine, health: DeviceHealth, counters: StoreCounters,
                 page_bytes: int, io_depth: int, sync_writes: bool, on_device_full: Callable[[int], None]):
        self.layout = layout
        self.engine = engine
        self.health = health
        self.counters = counters
        self.page_bytes = page_bytes
        self.slot_bytes = layout.slot_bytes
        self._ndev = len(layout.arenas)
        self._bounce = BouncePool(self.slot_bytes, io_depth)
        self._depth = max(1, io_depth)  # the engine's IOs in flight (it is built with the same depth)
        self._sync_writes = sync_writes
        self._on_device_full = on_device_full
        self._errlog = RateLimitedLog(log)

    def close(self) -> None:
        """Close the engine (its threads or rings end here) and free the bounce buffers, the buffers whatever
        the engine's close raised (then its error)."""
        release_all([("io engine", self.engine.close), ("bounce buffers", self._bounce.close)])

    def write(self, items: list[WriteItem]) -> list[int | None]:
        """Write pages to their slots; the checksum of each written page, or None where it failed."""
        sums: list[int | None] = [None] * len(items)
        step = len(items) if not self._needs_bounce_any([r for r, _ in items]) else self._bounce.count
        for start in range(0, len(items), step):
            ops: list[IOOp] = []
            placed: list[tuple[int, AlignedBuffer | None]] = []  # (item index, bounce)
            chunk = range(start, min(start + step, len(items)))
            spare = self._take_bounces([items[j][0] for j in chunk])
            for j in chunk:
                runs, slot = items[j]
                if not self.health.usable(slot % self._ndev):
                    continue  # the device's circuit is open: fail fast, no IO
                try:
                    op, bounce = self._make_op(OpKind.WRITE, slot, runs, spare)
                except OSError as exc:  # a segment could not be created: the device is full
                    self._device_full(slot, exc)
                    continue
                ops.append(op)
                placed.append((j, bounce))
            results = self._run(ops)
            for (j, bounce), res, op in zip(placed, results, ops):
                self.health.record(op.device, res.ok, res.seconds)
                if res.ok:
                    sums[j] = res.checksum if bounce is None else digest([bounce.view[:self.page_bytes]])
                else:
                    self.counters.io_errors += 1
                    self._errlog.error("write to %s failed: %s", self._arena(items[j][1]).path, res.error)
                if bounce is not None:
                    self._bounce.release(bounce)
            self._give_back(spare)
            if self._sync_writes:
                self._sync_data({op.fd for op, res in zip(ops, results) if res.ok})
        return sums

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
        return self.layout.direct and (self.slot_bytes != self.page_bytes or not runs_aligned(runs, ALIGN))

    def _take_bounces(self, pages: Sequence[Sequence[Run]]) -> list[AlignedBuffer]:
        """Every bounce buffer a chunk (at most the pool's size) needs, taken at once: taking them one by one,
        two threads' chunks could each hold part of the pool and wait for the rest forever."""
        return self._bounce.acquire_many(sum(self._needs_bounce(runs) for runs in pages))

    def _give_back(self, spare: list[AlignedBuffer]) -> None:
        for buf in spare:  # taken for pages that did no IO (an open circuit, a segment not created)
            self._bounce.release(buf)
        spare.clear()

    def _make_op(self, kind: OpKind, slot: int, runs: Sequence[Run],
                 spare: list[AlignedBuffer]) -> tuple[IOOp, AlignedBuffer | None]:
        """The op for one page; a page that needs a bounce buffer takes one of ``spare``."""
        fd, offset = self._arena(slot).locate(slot // self._ndev)
        if not self._needs_bounce(runs):
            return IOOp(kind, fd, offset, [view(a, n) for a, n in runs], device=slot % self._ndev), None
        bounce = spare.pop()
        if kind is OpKind.WRITE:
            copy_runs_to(bounce.view, runs)
        return IOOp(kind, fd, offset, [bounce.view[:self.slot_bytes]], checksum=False, device=slot % self._ndev), bounce

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
                    op, bounce = self._make_op(OpKind.READ, slot, runs, spare)
                except OSError as exc:
                    self.counters.io_errors += 1
                    self._errlog.error("read of slot %d: %s", slot, exc)
                    verdicts[j] = ReadVerdict.IO_ERROR
                    continue
                placed.append((j, op, bounce))
            results = self._run([op for _, op, _ in placed])
            for (j, op, bounce), res in zip(placed, results):
                self.health.record(op.device, res.ok or res.short, res.seconds)
                verdicts[j] = self._verdict(res, bounce, items[j])
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
        got = res.checksum if bounce is None else digest([bounce.view[:self.page_bytes]])
        if got != checksum:
            return ReadVerdict.CORRUPT
        if bounce is not None:
            copy_to_runs(bounce.view, runs)
        return ReadVerdict.HIT


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
