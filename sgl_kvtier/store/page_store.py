"""PageStore: the one writer of a namespace shard (fixed-size KV pages on one or more flash devices).

It is a ``PageShard`` (``store.shard``: get / longest_prefix / stats, the pinned verified read path) that
also holds the shard's writer lock and journal. Read-only views are ``store.reader.PageReader``.

API (used by the SGLang adapter; pages are lists of ``(address, length)`` runs in caller memory; keys are
valid ``PageKey``s):
    put(keys, pages, parent=None) -> [bool]   True: stored, already stored, or declined by admission
    delete(keys) -> int, clear() -> int, checkpoint(), close()        (and everything a PageShard serves)

Write order for a put batch, one named phase each (the crash rule each step relies on is at its code):
    1. reserve   under the lock: admit each page, take a free slot (evicting as needed; the victims'
                 DEL records are appended to the journal before their slots are overwritten)
    2. write     no lock: write the page data; fdatasync the data files (durability ``batch``/``always``)
    3. publish   under the lock: append the PUT records and make the pages visible, in the same section
    4. persist   fsync the journal (unless durability is ``none``): only then is the batch acknowledged;
                 checkpoint when enough records piled up
A page is visible only once its bytes are fully written; a record never points at bytes not written.
Under ``always`` each page is its own batch. Open order: writer lock -> layout (created if needed) ->
CONFIG -> engine -> recover -> a new journal generation (never appending to an old one) -> fold what was
replayed; an open failing at any step releases what it took, the lock last.

Close order: checkpoint -> journal -> engine (its threads end) -> devices -> writer lock, each step
attempted whatever an earlier one raised; the first failure is raised after as ``StoreCloseError``
(``store.lifecycle``). A failed checkpoint never loses an acknowledged page: the next open replays the
journals that the last good checkpoint does not cover.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from sgl_kvtier.config import Durability, StoreConfig
from sgl_kvtier.io.buffers import Run
from sgl_kvtier.io.engine import IOEngine
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.policy.admission import AdmissionFilter
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store.layout import Layout, acquire_writer_lock, meta_dir, open_layout, release_writer_lock, save_config
from sgl_kvtier.store.lifecycle import Acquired, Step
from sgl_kvtier.store.shard import PageShard, collector_paused, open_shard_engine, own_engine


@dataclass
class _PutBatch:
    """One put batch between its phases."""

    results: list[bool]
    reserved: list[tuple[int, int]] = field(default_factory=list)  # (page index, slot) of pages to write


class PageStore(PageShard):
    """The writer of one namespace shard: put / delete / clear / checkpoint over the shared read path."""

    def __init__(self, config: StoreConfig, namespace: Namespace, layout: Layout, lock_fd: int,
                 recovered: jr.Recovered, engine: IOEngine, journal: jr.Journal):
        super().__init__(config, namespace, layout, recovered, layout.capacity_slots, engine)
        self._lock_fd: int | None = lock_fd  # None once released
        self._checkpoint_lock = threading.Lock()
        self._admission = AdmissionFilter(config.admission_threshold)
        self._inflight: set[PageKey] = set()  # reserved, not yet published: a second put of one is "present"
        self._seq = recovered.seq
        self._journal = journal

    # ------------------------------------------------------------------ open / close
    @classmethod
    def open(cls, config: StoreConfig, namespace: Namespace, *, engine: IOEngine | None = None) -> PageStore:
        """Open (creating if needed) the shard of ``namespace`` on ``config.devices`` as its writer.
        ``engine`` (tests): the base engine to run IO on, the store's from this call on (closed by
        ``close``, or here if this fails).

        Raises: ConfigError, DeviceError, StoreFormatError, StoreLockedError, OSError (the fold below). A
        failed open has released everything it took, the writer lock last (``store.lifecycle``).
        """
        with Acquired(f"the writer of {namespace.dirname()}") as held:
            place = own_engine(held, engine)
            meta = meta_dir(config, namespace)
            lock_fd = acquire_writer_lock(meta)  # first file: nothing of the shard is touched without the lock
            held.push("writer lock", partial(release_writer_lock, lock_fd))
            layout = open_layout(config, namespace, meta, create=True)
            held.push("devices", layout.close)
            save_config(meta, config)
            io_engine = open_shard_engine(config, engine, held, place)
            with collector_paused():
                recovered = jr.recover(meta)
                # A new generation: a torn tail of an earlier run stays where that file's replay stops.
                journal = jr.Journal(meta, recovered.generation)
                held.push("journal", journal.close)
                store = cls(config, namespace, layout, lock_fd, recovered, io_engine, journal)
            held.hand_over(store._release_steps())  # the store's own release steps, from here on
            if recovered.replayed_records or recovered.problems:
                store.checkpoint()  # fold what was replayed (and drop torn journals) so the next open is fast
            return store

    def close(self) -> None:
        """Checkpoint, close the journal, the engine and the devices, then release the writer lock: every
        step whatever the earlier ones raised (``PageShard.close``). Idempotent.

        Raises ``StoreCloseError`` from the first failure, after all of it is released. A failed checkpoint
        loses nothing acknowledged: it leaves the old checkpoint and every journal it does not cover, and
        the next open replays them.
        """
        super().close()

    def _close_steps(self) -> list[Step]:
        # The checkpoint is attempted first, so the next open replays nothing; when it fails, the journal
        # (synced by every acknowledged put) still holds everything, and the release steps run regardless.
        return [("checkpoint", self.checkpoint), *self._release_steps()]

    def _release_steps(self) -> list[Step]:
        # Crash rule: the writer lock goes last, once every file of the shard is closed, so the next writer
        # never overlaps a descriptor of this one; the journal goes first (nothing is appended after).
        return [("journal", self._close_journal), *super()._release_steps(), ("writer lock", self._release_lock)]

    def _close_journal(self) -> None:
        self._journal.close()  # late-bound: ``checkpoint`` replaces the journal

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None  # detached first: released once, even if that fails
        if fd is not None:
            release_writer_lock(fd)

    # ------------------------------------------------------------------ put
    def put(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]], parent: PageKey | None = None) -> list[bool]:
        """Store pages; ``parent`` is the key that ``keys[0]`` chains on (for chain-aware eviction), and
        each later page chains on the key before it."""
        self._check_open()
        if self.config.durability is Durability.ALWAYS and len(keys) > 1:
            return [ok for i in range(len(keys))
                    for ok in self.put(keys[i:i + 1], pages[i:i + 1], keys[i - 1] if i else parent)]
        batch = self._reserve(keys, pages)
        if batch.reserved:
            checksums = self._write(pages, batch)
            due = self._publish(keys, parent, batch, checksums)
            self._persist(due)
        return batch.results

    def _reserve(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]]) -> _PutBatch:
        """Phase 1 (under the lock): admit each page and give it a slot, evicting as needed."""
        batch = _PutBatch([True] * len(keys))
        evicted: list[bytes] = []
        with self._lock:
            seen: set[PageKey] = set()
            for i, (key, runs) in enumerate(zip(keys, pages)):
                if not self._valid_page(key, runs, "put"):
                    batch.results[i] = False
                elif key in self._index or key in self._inflight or key in seen:
                    self.counters.put_present += 1
                elif not self._admission.offer(key):
                    self.counters.put_declined += 1
                else:
                    slot = self._reserve_slot(evicted)
                    if slot is None:
                        batch.results[i] = False
                        self.counters.put_no_space += 1
                        continue
                    seen.add(key)
                    self._inflight.add(key)
                    batch.reserved.append((i, slot))
            # Crash rule: a victim's DEL goes to the journal before phase 2 overwrites its slot. It is not
            # synced yet; if a crash loses it, replay maps the victim to bytes of another page, which fail
            # the victim's checksum: a miss, never wrong KV.
            self._journal.append(evicted)
        return batch

    def _write(self, pages: Sequence[Sequence[Run]], batch: _PutBatch) -> list[int | None]:
        """Phase 2 (no lock): write the reserved pages; per page its checksum, or None where it failed."""
        # Crash rule: the data is written and (durability batch/always) fdatasync'd here, before phase 3
        # appends any record naming it, so a replayed record never points at unwritten bytes.
        return self._io.write([(pages[i], slot) for i, slot in batch.reserved])

    def _publish(self, keys: Sequence[PageKey], parent: PageKey | None, batch: _PutBatch,
                 checksums: list[int | None]) -> bool:
        """Phase 3 (under the lock): journal and publish the written pages, free the slots of failed ones.
        True when a checkpoint is due."""
        records: list[bytes] = []
        with self._lock:
            for (i, slot), checksum in zip(batch.reserved, checksums):
                key = keys[i]
                self._inflight.discard(key)
                if checksum is None:
                    batch.results[i] = False
                    self._slots.release(slot)
                    continue
                chain_parent = keys[i - 1] if i > 0 else parent
                self._seq += 1
                records.append(jr.put_record(self._seq, key, slot, checksum, chain_parent))
                self._index.add(key, slot, checksum, chain_parent)
                self.counters.put_pages += 1
                self.counters.bytes_written += self.page_bytes
            # Crash rule: records are appended in the section that publishes their pages, so the journal's
            # order is the order readers saw (a later DEL of a page can never precede its PUT).
            self._journal.append(records)
            return self._journal.records >= self.config.checkpoint_interval

    def _persist(self, checkpoint_due: bool) -> None:
        """Phase 4 (no lock): make the batch's records durable, then checkpoint if one is due."""
        if self.config.durability is not Durability.NONE:
            self._journal.sync()  # crash rule: the batch is acknowledged (put returns) only after this
        if checkpoint_due:
            self.checkpoint()

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

    # ------------------------------------------------------------------ delete / maintenance
    def _drop(self, key: PageKey, records: list[bytes]) -> None:
        """Forget a page (under the lock) and add its DEL record to ``records``."""
        self._remove(key)
        records.append(self._del_record(key))

    def _dropped(self, keys: list[PageKey]) -> None:
        self._journal.append([self._del_record(key) for key in keys])

    def _del_record(self, key: PageKey) -> bytes:
        self._seq += 1
        return jr.del_record(self._seq, key)

    def delete(self, keys: Sequence[PageKey]) -> int:
        """Drop the stored pages among ``keys``; how many were dropped (durable unless durability is none)."""
        self._check_open()
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
        """Drop every page; how many were dropped."""
        with self._lock:
            keys = list(self._index.slot_of)
        return self.delete(keys)

    def checkpoint(self) -> None:
        """Snapshot the index into ``checkpoint.bin`` and start a new journal generation.

        Crash rule: the snapshot and the rotation happen in one lock section, so the checkpoint covers
        exactly the journals below the new generation; ``write_checkpoint`` replaces the file atomically
        and only then deletes those journals (a crash leaves the old checkpoint with all its journals).
        """
        with self._checkpoint_lock:
            with self._lock:
                snapshot = self._index.snapshot()
                seq = self._seq
                old = self._journal
                old.sync()
                self._journal = jr.Journal(self.layout.meta, old.generation + 1)
                old.close()
            jr.write_checkpoint(self.layout.meta, *snapshot, seq, self._journal.generation)
