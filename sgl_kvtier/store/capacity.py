"""A writer's slots against the pool-wide cap (``CapacitySide``, a ``PageStore`` mixin): what its lease
publishes, and what the pool quota and the other writers' uses do to its pages. With no other writer
(``peer_bytes`` answers 0) the cap is this writer's own.

    usage()                 the lease's fields (pages, bytes, capacity, journal cursor, age histogram), kept
                            as ``published`` with the clock's time, so the quota plans with exactly that
    pool_capacity_bytes()   the pool-wide byte limit the quota keeps
    evict_older_than(age_s, now, limit_bytes) -> (pages, bytes punched)   the quota's eviction
    touch_own(keys) / touch_remote(keys)   uses of own pages by others / of others' pages (TOUCH records)
    _reserve_slot(evicted)  a slot for a put's next page within the cap and the quota's ``grow_limit_bytes``,
                            evicting own coldest pages to get there (never another writer's)

Everything runs under the store's lock, like the rest of the writer (``store.page_store``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from sgl_kvtier.config import Sharing, StoreConfig
from sgl_kvtier.keys import PageKey
from sgl_kvtier.store import journal_write as jw
from sgl_kvtier.store.index import PageIndex
from sgl_kvtier.store.layout import Layout
from sgl_kvtier.store.meta import WriterJournal
from sgl_kvtier.store.slots import SlotTable
from sgl_kvtier.telemetry.counters import StoreCounters

TOUCH_INTERVAL_S = 60.0  # a remote page's use is journaled at most once per this many seconds


class CapacitySide:
    """See the module docstring; ``PageStore`` provides the state."""

    config: StoreConfig
    layout: Layout
    counters: StoreCounters
    slot_bytes: int
    clock: Callable[[], float]
    published: tuple[float, dict[str, Any]] | None
    peer_bytes: Callable[[], int]
    grow_limit_bytes: int | None
    _inflight: set[PageKey]
    _lock: threading.Lock
    _index: PageIndex
    _slots: SlotTable
    _journal: WriterJournal
    _touched: dict[PageKey, float]
    _seq: int
    _ndev: int
    _closed: bool

    def _check_open(self) -> None:
        raise NotImplementedError

    def _drop(self, key: PageKey, records: list[bytes]) -> None:
        raise NotImplementedError

    def _journal_sync_due(self) -> bool:
        raise NotImplementedError

    def _reserve_slot(self, evicted: list[bytes]) -> int | None:
        """A slot for one more page (under the lock), evicting own pages while the pool is at its cap or
        no slot is free; None when nothing of its own is left to evict."""
        while self._at_pool_cap():
            if not self._evict_coldest(evicted):
                return None
        slot = self._slots.allocate()
        while slot is None:
            if not self._evict_coldest(evicted):
                return None
            slot = self._slots.allocate()
        return slot

    def _at_pool_cap(self) -> bool:
        """Whether one more page would take the pool (own pages + the peers' leased bytes) past its cap, or
        this writer past the quota's growth limit."""
        own = (len(self._index) + len(self._inflight) + 1) * self.slot_bytes
        limit = self.grow_limit_bytes
        return own + self.peer_bytes() > self._slots.capacity * self.slot_bytes or (limit is not None and own > limit)

    def _evict_coldest(self, evicted: list[bytes]) -> bool:
        victim = self._index.victim()
        if victim is None:
            return False
        self._drop(victim, evicted)
        self.counters.evictions += 1
        return True

    def usage(self) -> dict[str, Any]:
        """What the lease publishes of this writer: pages, bytes, its capacity, journal cursor and the bytes
        per page-age bucket (``PageIndex.age_histogram``, trailing empty buckets left out). Kept as
        ``published`` with the clock's time, so the quota plans with exactly what the lease said."""
        with self._lock:
            now = self.clock()
            pages = len(self._index)
            hist = list(self._index.age_histogram(now, self.slot_bytes))
            if self.config.sharing is Sharing.CLUSTER and self._journal.synced < self._journal.size:
                # Crash/visibility rule: other hosts replay only what a lease announced, so announce only
                # synced records (TOUCHes and dropped-page DELs are never synced on their own: do it here).
                self._journal.sync()
            fields = {"pages": pages, "bytes_used": pages * self.slot_bytes,
                      "capacity_bytes": self._slots.capacity * self.slot_bytes,
                      "journal": [self._journal.generation, self._journal.synced]}
        while hist and not hist[-1]:
            hist.pop()
        fields["age_hist"] = hist
        self.published = (now, fields)
        return fields

    def pool_capacity_bytes(self) -> int:
        """The pool-wide byte limit the quota keeps: ``capacity_bytes``, or (None) this layout's capacity."""
        layout_bytes = self._slots.capacity * self.slot_bytes
        return layout_bytes if self.config.capacity_bytes is None else min(self.config.capacity_bytes, layout_bytes)

    def evict_older_than(self, age_s: float, now: float, limit_bytes: int) -> tuple[int, int]:
        """The quota's eviction: own pages at least ``age_s`` old at ``now`` (the clock's, as ``usage``
        published them), in the policy's drop order (chain: deepest first), until ``limit_bytes``; then
        holes over the freed slots no reader pins. Returns (pages evicted, bytes punched)."""
        self._check_open()
        records: list[bytes] = []
        with self._lock:
            victims = self._index.victims_older_than(age_s, now, limit_bytes, self.slot_bytes)
            slots = [s for s in (self._index.slot_of[k] for k in victims) if not self._slots.pinned(s)]
            for key in victims:
                self._drop(key, records)
            self.counters.evictions += len(records)
            self._journal.append(records)
            # Crash rule: the DELs are appended before their slots are punched (and the punch is under the
            # lock, so no put can take a slot in between). A crash losing the unsynced DELs replays a page
            # over zeros: its checksum fails, a miss, never wrong KV.
            punched = self._punch(slots)
        if records and self._journal_sync_due():
            self._journal.sync()
        return len(records), punched

    def _punch(self, slots: list[int]) -> int:
        by_arena: dict[int, list[int]] = {}
        for slot in slots:
            by_arena.setdefault(slot % self._ndev, []).append(slot // self._ndev)
        return sum(self.layout.arenas[a].punch_free(local) for a, local in by_arena.items())

    def touch_own(self, keys: Sequence[PageKey]) -> None:
        """Other writers used these pages of ours (their TOUCH records): as warm as our own reads."""
        with self._lock:
            self._index.touch(keys)

    def touch_remote(self, keys: Sequence[PageKey], now: float | None = None) -> None:
        """We read these pages from other writers: journal a TOUCH for each (at most once per key per
        TOUCH_INTERVAL_S; not synced: a lost use costs nothing but warmth), for their owners to count."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._closed:
                return
            fresh = [k for k in keys if now - self._touched.get(k, -TOUCH_INTERVAL_S) >= TOUCH_INTERVAL_S]
            if len(self._touched) > 1 << 16:
                self._touched = {k: t for k, t in self._touched.items() if now - t < TOUCH_INTERVAL_S}
            records = []
            for key in fresh:
                self._touched[key] = now
                self._seq += 1
                records.append(jw.touch_record(self._seq, key))
            try:
                self._journal.append(records)
            except OSError:  # a full journal area (a shared raw pool's): a lost use costs warmth only
                return
