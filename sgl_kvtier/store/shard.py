"""PageShard: an open namespace shard's index, slots and devices, and its verified read path.

Base of ``store.page_store.PageStore`` (the shard's one writer) and ``sharing.follower.PageReader`` (a
follower of a live writer, or an offline view). It holds the layout, the in-memory index and slot table, the
IO engine behind ``PageIO``, the devices' circuit breakers, counters and measured read rates.

API (pages are ``(address, length)`` runs in caller memory; keys are valid ``PageKey``s):
    get(keys, pages) -> [bool]        True: the page's bytes, verified, are in the caller's runs
    get_parts(keys, pages, on_part, groups=None) -> [bool]   the same, group-major (``store.part_reads``)
    longest_prefix(keys) -> int       how many leading keys are readable
    contains / slot_of / parent_of / keys / len, stats(), close()

Read path of a batch: pin (under the lock: look each key up, pin its slot, touch the policy) -> read (no
lock: one vectored IO per page, each part checked against its xxh3-64 taken at write time) -> unpin ->
settle (under the lock: count, drop every ``CORRUPT`` page through ``_dropped``). A pinned slot is never
handed to a writer, and a stale index can only read bytes that fail their checksum: a miss, never wrong KV.
Nothing on this path writes a file. One lock per instance guards index, slots and policy; IO runs outside
it. Every instance owns its state (the collector pause is the one shared thing), so any number of readers
and one writer per shard may be open at once, in one process or many. Open and close: ``store.lifecycle``.
"""

from __future__ import annotations

import abc
import gc
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sgl_kvtier.config import Durability, StoreConfig
from sgl_kvtier.errors import StoreClosedError
from sgl_kvtier.io.buffers import Run
from sgl_kvtier.io.engine import IOEngine
from sgl_kvtier.io.factory import open_engine
from sgl_kvtier.keys import KEY_BYTES, Namespace, PageKey
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store.health import DeviceHealth
from sgl_kvtier.store.index import PageIndex
from sgl_kvtier.store.layout import Layout
from sgl_kvtier.store.lifecycle import Acquired, ClosedOnExit, Step, close_all, weak_method
from sgl_kvtier.store.part_reads import OnPart, PartRead, drive
from sgl_kvtier.store.parts import Checksum
from sgl_kvtier.store.read_rates import ReadRates
from sgl_kvtier.store.slots import SlotTable
from sgl_kvtier.store.transfer import PageIO, ReadVerdict, SlotIdentity
from sgl_kvtier.telemetry.counters import RateLimitedLog, StoreCounters, StoreStats

log = logging.getLogger(__name__)
Pinned = list[tuple[int, tuple[int, Checksum]]]  # (page index in the batch, (slot, checksums)) per pinned page


class _CollectorPause:
    """Keeps Python's cyclic collector off while any shard loads its index (many fresh objects it would
    rescan again and again); overlapping loads on several threads re-enable it after the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._was_enabled:
                gc.enable()


_COLLECTOR_PAUSE = _CollectorPause()


def collector_paused() -> _CollectorPause:
    """The shared collector pause, for recovering an index and building a shard on it."""
    return _COLLECTOR_PAUSE


def own_engine(held: Acquired, base: IOEngine | None) -> int | None:
    """A shard being opened takes ``base`` over at once: if the open fails, ``held`` closes it too.
    Returns its place in ``held``, for ``open_shard_engine``."""
    return None if base is None else held.push("io engine", base.close)


def open_shard_engine(config: StoreConfig, base: IOEngine | None, held: Acquired, place: int | None) -> IOEngine:
    """The engine stack of a shard being opened (``base`` inside it), held by ``held`` from here on."""
    engine = open_engine(config, base)
    if place is not None:
        held.drop(place)  # closing the stack closes ``base`` inside it, once
    held.push("io engine", engine.close)  # released where a shard's close releases it: before the devices
    return engine


@dataclass(frozen=True)
class SharedTelemetry:
    """Counters, breakers and read rates that several shards of one pool share (``sharing.pool``): the
    devices are the same, and a pool reports one set of figures. Each is thread-safe or bumped like
    a shard's own counters."""

    counters: StoreCounters
    health: DeviceHealth
    read_rates: ReadRates


class PageShard(ClosedOnExit, abc.ABC):
    """An open namespace shard: its index, slots and devices, and the verified read path (see the module
    docstring). Open one through ``PageReader.open`` or ``sharing.sites.open_writer``."""

    CLOSING = "the shard"

    def __init__(self, config: StoreConfig, namespace: Namespace, layout: Layout, recovered: jr.Recovered,
                 capacity: int, engine: IOEngine, *, identity: SlotIdentity | None = None,
                 shared: SharedTelemetry | None = None):
        self.config = config
        self.namespace = namespace
        self.layout = layout
        self.page_bytes = namespace.page_bytes
        self.slot_bytes = layout.slot_bytes
        self.recovery = recovered  # what was rebuilt from disk (problems found, records replayed)
        self.counters = StoreCounters() if shared is None else shared.counters
        self._lock = threading.Lock()
        self._closed = False
        self._errlog = RateLimitedLog(log)
        self._engine = engine  # the whole stack (``open_shard_engine``); the shard owns and closes it
        self._ndev = len(layout.arenas)
        if shared is None:
            shared = SharedTelemetry(self.counters,
                                     DeviceHealth([a.path for a in layout.arenas], config.breaker_failures,
                                                  config.breaker_cooldown_s, config.slow_io_s),
                                     ReadRates(self._ndev))
        self.health = shared.health
        self.read_rates = shared.read_rates  # moving-average read bandwidth / batch latency (cost model)
        self._io = PageIO(layout, self._engine, self.health, self.counters, self.page_bytes, config.io_depth,
                          config.durability is not Durability.NONE, weak_method(self._device_full, None),
                          identity=identity, parts=namespace.part_sizes())  # (weakly: no reference cycle)
        self._index = PageIndex(recovered, config.eviction, capacity)
        self._slots = SlotTable(capacity, self._index.slots())

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Release everything the shard holds (``_close_steps``, each step whatever the others raise); later
        calls to the shard raise ``StoreClosedError``.

        Raises ``StoreCloseError`` (from the first failure) once every step ran; the shard is released and
        closed all the same. Idempotent: a second call, after a failed one too, does nothing.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        close_all(str(self.layout.meta), self._close_steps())

    def _close_steps(self) -> list[Step]:
        """What ``close`` runs, in order (a writer checkpoints first)."""
        return self._release_steps()

    def _release_steps(self) -> list[Step]:
        """What releases everything the shard holds, newest first (also a failed open's clean-up)."""
        return [("io engine", self._io.close), ("devices", self.layout.close)]

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("page store is closed")

    # ------------------------------------------------------------------ queries
    def longest_prefix(self, keys: Sequence[PageKey]) -> int:
        """How many leading ``keys`` are stored on a device whose circuit is not open."""
        self._check_open()
        with self._lock:
            slot_of, usable = self._index.slot_of, self.health.usable
            for i, key in enumerate(keys):
                slot = slot_of.get(key)
                if slot is None or not usable(slot % self._ndev):
                    return i
        return len(keys)

    def contains(self, key: PageKey) -> bool:
        """Whether ``key`` is in the index (its device may still be unusable)."""
        return key in self._index

    def slot_of(self, key: PageKey) -> int | None:
        """The global slot holding ``key``, or None."""
        return self._index.slot_of.get(key)

    def parent_of(self, key: PageKey) -> PageKey | None:
        """The stored page ``key`` chains on (chain-aware eviction's link), or None."""
        return self._index.parent_of(key)

    def keys(self) -> list[PageKey]:
        """Every stored key, coldest first."""
        with self._lock:
            return list(self._index.slot_of)

    def __len__(self) -> int:
        return len(self._index)

    def stats(self) -> StoreStats:
        """Pages, bytes used / capacity, devices and counters, as one snapshot."""
        with self._lock:
            pages = len(self._index)
            return StoreStats(
                namespace=self.namespace.describe(), devices=[a.path for a in self.layout.arenas],
                direct_io=self.layout.direct, engine=self._engine.name, pages=pages, slot_bytes=self.slot_bytes,
                bytes_used=pages * self.slot_bytes, capacity_bytes=self._slots.capacity * self.slot_bytes,
                counters=self.counters.snapshot())

    # ------------------------------------------------------------------ reads
    def get(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]]) -> list[bool]:
        """Read pages into the caller's runs; False for a miss or for any page that fails verification."""
        self._check_open()
        results = [False] * len(keys)
        pinned = self._pin(keys, pages)
        if not pinned:
            return results
        start = time.perf_counter()
        try:
            verdicts, busy = self._io.read_timed([(pages[i], entry) for i, entry in pinned])
        finally:
            self._unpin(pinned)
        # The total on the batch's wall clock (what a load waits for); each device on its own ops' time.
        self.read_rates.record([e[0] % self._ndev for (_, e), v in zip(pinned, verdicts) if v is ReadVerdict.HIT],
                               self.page_bytes, time.perf_counter() - start, busy)
        if ReadVerdict.CORRUPT in verdicts:
            self._before_corrupt()
        self._settle(keys, pinned, verdicts, results)
        return results

    def get_parts(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]], on_part: OnPart,
                  groups: Sequence[Sequence[int]] | None = None) -> list[bool]:
        """Read pages group-major (``store.part_reads``): the parts of group 0 of every page (by default
        group ``p`` is part ``p``), verified, then ``on_part(0, ok)`` (``ok[i]``: page i's groups so far
        are verified in its runs), then group 1, ... A page failing a part in group g gets no IO from group
        g + 2 on (g + 1 is in flight beside g). Returns what ``get`` would: True for the pages read whole.

        Raises ValueError when ``groups`` do not cover every part once; what ``on_part`` raises, once the
        IO in flight landed and the batch's pins and buffers are released."""
        plan = self._io.parts.plan(groups)
        return drive([self.part_read(keys, pages, plan)], len(keys), len(plan), on_part)

    def part_read(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]], plan: list[tuple[int, ...]],
                  positions: Sequence[int] | None = None) -> PartRead:
        """This shard's share of a group-major read (``store.part_reads.drive`` runs it): its pages pinned
        from now until the read's ``close``. ``positions``: each key's index in the caller's batch."""
        self._check_open()
        pinned = self._pin(keys, pages)
        where = range(len(keys)) if positions is None else positions

        def release(verdicts: list[ReadVerdict], seconds: float, busy: list[float]) -> None:
            self._unpin(pinned)
            if pinned and seconds > 0:
                self.read_rates.record([e[0] % self._ndev for (_, e), v in zip(pinned, verdicts)
                                        if v is ReadVerdict.HIT], self.page_bytes, seconds, busy)
            if ReadVerdict.CORRUPT in verdicts:
                self._before_corrupt()
            self._settle(keys, pinned, verdicts, [False] * len(keys))

        try:
            return PartRead(self._io, [(where[i], pages[i], e) for i, e in pinned], plan, release)
        except BaseException:
            self._unpin(pinned)
            raise

    def _pin(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]]) -> Pinned:
        """Read phase 1 (under the lock): find each page and pin its slot, so no writer reuses it mid-read."""
        pinned: Pinned = []
        with self._lock:
            for i, (key, runs) in enumerate(zip(keys, pages)):
                if not self._valid_page(key, runs, "get"):
                    continue
                entry = self._index.lookup(key)
                if entry is None:
                    self.counters.get_misses += 1
                    continue
                self._slots.pin(entry[0])
                pinned.append((i, entry))
            self._index.touch([keys[i] for i, _ in pinned])
        return pinned

    def _unpin(self, pinned: Pinned) -> None:
        with self._lock:
            for _, (slot, _) in pinned:
                self._slots.unpin(slot)

    def _settle(self, keys: Sequence[PageKey], pinned: Pinned, verdicts: list[ReadVerdict],
                results: list[bool]) -> None:
        """Read phase 3 (under the lock): count hits and misses, drop the pages found corrupt."""
        bad: list[PageKey] = []
        with self._lock:
            for (i, entry), verdict in zip(pinned, verdicts):
                if verdict is ReadVerdict.HIT:
                    results[i] = True
                    self.counters.get_hits += 1
                    self.counters.bytes_read += self.page_bytes
                    continue
                self.counters.get_misses += 1
                # Only the page that was read is dropped: if the key moved meanwhile (rewritten, or a
                # follower refreshed), its new entry differs and stays. This also drops a key listed twice once.
                if verdict is not ReadVerdict.CORRUPT:
                    continue
                if self._index.lookup(keys[i]) != entry:
                    if self.follows_peer:  # its owner reused the slot since: a race, not damage
                        self.counters.remote_reuse_races += 1
                        log.debug("page %s of %s changed under a read (slot reused)", keys[i].hex()[:16],
                                  self.layout.meta)
                    continue
                self.counters.corrupt_pages += 1
                self._errlog.error("page %s failed its checksum or was short; dropped (a miss)", keys[i].hex()[:16])
                self._remove(keys[i])
                bad.append(keys[i])
            if bad:
                self._dropped(bad)

    # ------------------------------------------------------------------ bookkeeping (under the lock)
    def _remove(self, key: PageKey) -> None:
        """Forget a page (under the lock); its slot is reused once no reader holds it."""
        self._slots.release(self._index.remove(key))

    follows_peer = False  # a reader of another writer's pages (``sharing.pool``): classifies reuse races

    def _before_corrupt(self) -> None:
        """A read batch found pages failing their checksums; a follower re-reads its writer's journal
        first, so a page whose slot was reused since is told from a damaged one."""
        return None

    @abc.abstractmethod
    def _dropped(self, keys: list[PageKey]) -> None:
        """Pages the read path just removed as corrupt (under the lock): a writer journals their deletion,
        a reader keeps it in memory."""

    def _device_full(self, slot: int) -> None:
        with self._lock:
            self._slots.shrink(slot)

    def _valid_page(self, key: PageKey, runs: Sequence[Run], op: str) -> bool:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            self.counters.bad_requests += 1
            self._errlog.error("%s: key must be %d bytes, got %r", op, KEY_BYTES, key)
            return False
        total = sum(n for _, n in runs)
        if total != self.page_bytes:
            self.counters.bad_requests += 1
            self._errlog.error("%s: page runs add up to %d bytes, this store's pages are %d", op, total,
                               self.page_bytes)
            return False
        return True
