"""PageStore: fixed-size KV pages of one namespace shard on one or more flash devices.

API (used by the SGLang adapter; pages are lists of ``(address, length)`` runs in caller memory):
    put(keys, pages, parent=None) -> [bool]   True: stored, already stored, or declined by admission
    get(keys, pages) -> [bool]                True: the page's bytes, verified, are in the caller's runs
    longest_prefix(keys) -> int               how many leading keys are readable now
    delete(keys), clear(), stats(), close()

Write order for a put batch: reserve slots (evicting as needed) -> write page data -> fdatasync the data
files (durability ``batch``/``always``) -> append the journal records and publish the pages to readers ->
fsync the journal. A page is visible only once its bytes are fully written; a reader pins its slots so an
eviction cannot hand a slot to a writer mid-read. Every read is checked against the xxh3-64 taken at
write time: a mismatch or short read drops the page and counts it; its bytes are never reported good.

Thread safety: one lock guards the index, slots, policy and journal appends; IO runs outside it, so
SGLang's exists / get / set threads proceed in parallel.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from typing import Sequence

from sgl_kvtier.config import Durability, StoreConfig
from sgl_kvtier.errors import StoreClosedError
from sgl_kvtier.io.buffers import Run
from sgl_kvtier.io.engine import IOEngine, make_engine
from sgl_kvtier.io.faulty import FaultyEngine
from sgl_kvtier.io.throttle import ThrottledEngine
from sgl_kvtier.keys import KEY_BYTES, Namespace, PageKey
from sgl_kvtier.metrics import RateLimitedLog, StoreCounters, StoreStats
from sgl_kvtier.policy.admission import AdmissionFilter
from sgl_kvtier.policy.cost_model import ReadRates
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store.health import DeviceHealth
from sgl_kvtier.store.index import PageIndex
from sgl_kvtier.store.layout import Layout, acquire_writer_lock, meta_dir, open_layout, save_config
from sgl_kvtier.store.slots import SlotTable
from sgl_kvtier.store.transfer import PageIO

log = logging.getLogger(__name__)


@contextlib.contextmanager
def gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class PageStore:
    def __init__(self, config: StoreConfig, namespace: Namespace, layout: Layout, lock_fd: int | None,
                 recovered: jr.Recovered, engine: IOEngine | None = None):
        self.config = config
        self.namespace = namespace
        self.layout = layout
        self.page_bytes = namespace.page_bytes
        self.slot_bytes = layout.slot_bytes
        self.readonly = lock_fd is None
        self._lock_fd = lock_fd
        self._lock = threading.Lock()
        self._checkpoint_lock = threading.Lock()
        self._closed = False
        self.counters = StoreCounters()
        self._errlog = RateLimitedLog(log)
        self._engine = engine or make_engine(config.io_engine.value, config.io_depth)
        if config.fault_injection:
            self._engine = FaultyEngine(self._engine, config.fault_injection)
        if config.throttle:  # benchmarks: a slower device; outermost, so real IO and faults run inside its time
            self._engine = ThrottledEngine(self._engine, config.throttle)
        self.health = DeviceHealth([a.path for a in layout.arenas], config.breaker_failures,
                                   config.breaker_cooldown_s, config.slow_io_s)
        self._ndev = len(layout.arenas)
        self.read_rates = ReadRates(self._ndev)  # moving-average read bandwidth / batch latency (cost model)
        self._io = PageIO(layout, self._engine, self.health, self.counters, self.page_bytes, config.io_depth,
                          config.durability is not Durability.NONE, self._device_full)
        self._admission = AdmissionFilter(config.admission_threshold)
        self._inflight: set[PageKey] = set()
        capacity = layout.capacity_slots
        if self.readonly:  # an offline reader shows everything that is there, whatever the limit now
            capacity = max([capacity, *(s + 1 for s in recovered.key_of)])
        self._index = PageIndex(recovered, config.eviction, capacity)
        self._slots = SlotTable(capacity, self._index.slots())
        self._seq = recovered.seq
        self.recovery = recovered
        self._journal = None if self.readonly else jr.Journal(layout.meta, recovered.generation)
        if self._journal is not None and (recovered.replayed_records or recovered.problems):
            self.checkpoint()  # fold what was replayed (and drop torn journals) so the next open is fast

    # ------------------------------------------------------------------ open / close
    @classmethod
    def open(cls, config: StoreConfig, namespace: Namespace, *, readonly: bool = False,
             engine: IOEngine | None = None) -> "PageStore":
        """Open (creating if needed) the shard of ``namespace`` on ``config.devices``.

        Raises: ConfigError, DeviceError, StoreFormatError, StoreLockedError.
        """
        meta = meta_dir(config, namespace)
        lock_fd = None
        if not readonly:
            lock_fd = acquire_writer_lock(meta)
        try:
            layout = open_layout(config, namespace, meta, create=not readonly)
            if not readonly:
                save_config(meta, config)
            try:
                with gc_paused():  # a million fresh index objects: the collector would rescan them all
                    return cls(config, namespace, layout, lock_fd, jr.recover(meta), engine)
            except BaseException:
                layout.close()
                raise
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            raise

    def close(self) -> None:
        if self._closed:
            return
        if self._journal is not None:
            self.checkpoint()
        self._closed = True
        if self._journal is not None:
            self._journal.close()
        self._io.close()
        self.layout.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock

    def __enter__(self) -> "PageStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("page store is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.readonly:
            raise StoreClosedError("page store is open read-only")

    # ------------------------------------------------------------------ queries
    def longest_prefix(self, keys: Sequence[PageKey]) -> int:
        self._check_open()
        with self._lock:
            slot_of, usable = self._index.slot_of, self.health.usable
            for i, key in enumerate(keys):
                slot = slot_of.get(key)
                if slot is None or not usable(slot % self._ndev):
                    return i
        return len(keys)

    def refresh(self) -> bool:
        """Read-only stores: pick up pages a live writer (another process) added or dropped since."""
        if not self.readonly:
            return False
        with self._lock:
            changed = jr.follow(self.layout.meta, self.recovery)
            # Replayed records land in place in the dicts the index shares with ``self.recovery``; only a
            # restart from a new checkpoint replaces them, and only then is the index rebuilt (a reader
            # never evicts, so its policy need not see the writer's new pages).
            if changed and self.recovery.slot_of is not self._index.slot_of:
                capacity = max([self._slots.capacity, *(s + 1 for s in self.recovery.key_of)])
                self._index = PageIndex(self.recovery, self.config.eviction, capacity)
                self._slots = SlotTable(capacity, self._index.slots())
            return changed

    def contains(self, key: PageKey) -> bool:
        return key in self._index

    def slot_of(self, key: PageKey) -> int | None:
        return self._index.slot_of.get(key)

    def parent_of(self, key: PageKey) -> PageKey | None:
        return self._index.parent_of(key)

    def keys(self) -> list[PageKey]:
        with self._lock:
            return list(self._index.slot_of)

    def __len__(self) -> int:
        return len(self._index)

    # ------------------------------------------------------------------ writes
    def put(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]], parent: PageKey | None = None) -> list[bool]:
        """Store pages; ``parent`` is the key that ``keys[0]`` chains on (for chain-aware eviction)."""
        self._check_writable()
        if self.config.durability is Durability.ALWAYS and len(keys) > 1:
            return [ok for i in range(len(keys))
                    for ok in self.put(keys[i:i + 1], pages[i:i + 1], keys[i - 1] if i else parent)]
        results = [True] * len(keys)
        todo: list[tuple[int, int]] = []  # (page index, slot)
        evicted: list[bytes] = []
        with self._lock:
            seen: set[PageKey] = set()
            for i, (key, runs) in enumerate(zip(keys, pages)):
                if not self._valid_page(key, runs, "put"):
                    results[i] = False
                elif key in self._index or key in self._inflight or key in seen:
                    self.counters.put_present += 1
                elif not self._admission.offer(key):
                    self.counters.put_declined += 1
                else:
                    slot = self._reserve_slot(evicted)
                    if slot is None:
                        results[i] = False
                        self.counters.put_no_space += 1
                        continue
                    seen.add(key)
                    self._inflight.add(key)
                    todo.append((i, slot))
            self._journal.append(evicted)
        if not todo:
            return results
        written = self._io.write([(keys[i], pages[i], slot) for i, slot in todo])
        records = []
        with self._lock:
            for (i, slot), checksum in zip(todo, written):
                key = keys[i]
                self._inflight.discard(key)
                if checksum is None:
                    results[i] = False
                    self._slots.release(slot)
                    continue
                chain_parent = keys[i - 1] if i > 0 else parent
                self._seq += 1
                records.append(jr.put_record(self._seq, key, slot, checksum, chain_parent))
                self._index.add(key, slot, checksum, chain_parent)
                self.counters.put_pages += 1
                self.counters.bytes_written += self.page_bytes
            self._journal.append(records)
            due = self._journal.records >= self.config.checkpoint_interval
        if self.config.durability is not Durability.NONE:
            self._journal.sync()
        if due:
            self.checkpoint()
        return results

    def _reserve_slot(self, evicted: list[bytes]) -> int | None:
        slot = self._slots.allocate()
        while slot is None:
            victim = self._index.victim()
            if victim is None:
                return None
            self._drop(victim, evicted)
            self.counters.evictions += 1
            slot = self._slots.allocate()
        return slot

    def _drop(self, key: PageKey, records: list[bytes]) -> None:
        """Forget a page (under the lock); its slot is reused once no reader holds it."""
        self._slots.release(self._index.remove(key))
        self._seq += 1
        records.append(jr.del_record(self._seq, key))

    def _device_full(self, slot: int) -> None:
        with self._lock:
            self._slots.shrink(slot)

    # ------------------------------------------------------------------ reads
    def get(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]]) -> list[bool]:
        """Read pages into the caller's runs; False for a miss or for any page that fails verification."""
        self._check_open()
        results = [False] * len(keys)
        todo: list[tuple[int, tuple[int, int]]] = []  # (page index, (slot, checksum))
        with self._lock:
            for i, (key, runs) in enumerate(zip(keys, pages)):
                if not self._valid_page(key, runs, "get"):
                    continue
                entry = self._index.lookup(key)
                if entry is None:
                    self.counters.get_misses += 1
                    continue
                self._slots.pin(entry[0])
                todo.append((i, entry))
            self._index.touch([keys[i] for i, _ in todo])
        if not todo:
            return results
        start = time.perf_counter()
        try:
            verdicts, busy = self._io.read_timed([(pages[i], e) for i, e in todo])
        finally:
            with self._lock:
                for _, (slot, _) in todo:
                    self._slots.unpin(slot)
        # The total on the batch's wall clock (what a load waits for); each device on its own ops' time.
        self.read_rates.record([e[0] % self._ndev for (_, e), v in zip(todo, verdicts) if v is True],
                               self.page_bytes, time.perf_counter() - start, busy)
        bad: list[bytes] = []
        with self._lock:
            for (i, entry), verdict in zip(todo, verdicts):
                if verdict is True:
                    results[i] = True
                    self.counters.get_hits += 1
                    self.counters.bytes_read += self.page_bytes
                    continue
                self.counters.get_misses += 1
                if verdict == "corrupt" and self._index.lookup(keys[i]) == entry:
                    self.counters.corrupt_pages += 1
                    self._errlog.error("page %s failed its checksum or was short; dropped (a miss)", keys[i].hex()[:16])
                    self._drop(keys[i], bad)
            if bad and self._journal is not None:
                self._journal.append(bad)
        return results

    # ------------------------------------------------------------------ maintenance
    def delete(self, keys: Sequence[PageKey]) -> int:
        self._check_writable()
        records: list[bytes] = []
        with self._lock:
            for key in keys:
                if key in self._index:
                    self._drop(key, records)
            self._journal.append(records)
        if records and self.config.durability is not Durability.NONE:
            self._journal.sync()
        return len(records)

    def clear(self) -> int:
        with self._lock:
            keys = list(self._index.slot_of)
        return self.delete(keys)

    def checkpoint(self) -> None:
        """Snapshot the index into ``checkpoint.bin`` and start a new journal generation."""
        with self._checkpoint_lock:
            with self._lock:
                snapshot = self._index.snapshot()
                seq = self._seq
                old = self._journal
                old.sync()
                self._journal = jr.Journal(self.layout.meta, old.generation + 1)
                old.close()
            jr.write_checkpoint(self.layout.meta, *snapshot, seq, self._journal.generation)

    def stats(self) -> StoreStats:
        with self._lock:
            pages = len(self._index)
            return StoreStats(
                namespace=self.namespace.describe(), devices=[a.path for a in self.layout.arenas],
                direct_io=self.layout.direct, engine=self._engine.name, pages=pages, slot_bytes=self.slot_bytes,
                bytes_used=pages * self.slot_bytes, capacity_bytes=self._slots.capacity * self.slot_bytes,
                counters=self.counters.snapshot())

    def _valid_page(self, key: PageKey, runs: Sequence[Run], op: str) -> bool:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            self.counters.bad_requests += 1
            self._errlog.error("%s: key must be %d bytes, got %r", op, KEY_BYTES, key)
            return False
        total = sum(n for _, n in runs)
        if total != self.page_bytes:
            self.counters.bad_requests += 1
            self._errlog.error("%s: page runs add up to %d bytes, this store's pages are %d", op, total, self.page_bytes)
            return False
        return True

