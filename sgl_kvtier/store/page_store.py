"""PageStore: the one writer of a namespace shard's directory (or shared raw region) and its pages.

A ``store.shard.PageShard`` (the verified read path) that also holds what its ``store.site.WriterSite``
claimed and started: the writer directory and its lock, the journal, and the lease beaten every
``heartbeat_s`` on the ``kvtier-lease`` thread (none under ``sharing = "off"``: the shard's one writer). It
imports neither the medium nor the sharing protocol: callers open it through ``sharing.sites.open_writer``,
and ``sharing.pool.SharedPool`` merges it with the other writers' ``sharing.follower.PageReader``s (under
``sharing = "off"``, ``sharing.sole.SoleShard`` serves it alone).

API (pages are ``(address, length)`` runs in caller memory; keys are valid ``PageKey``s):
    put(keys, pages, parent=None) -> [bool]   True: stored, already stored, or declined by admission
    delete(keys) / evict(keys) / clear() -> int, checkpoint(), close()
    usage(), evict_older_than(), touch_remote(keys), touch_own(keys)   (``store.capacity.CapacitySide``)
    and everything a PageShard serves

Pool-wide cap: ``capacity_bytes`` bounds the namespace shard over all its writers. A slot for a new page is
taken only while own pages (stored and in flight) plus the other writers' leased ``bytes_used``
(``peer_bytes``) stay within it; at the cap a writer evicts its own coldest pages, never another's. Leases
lag by up to ``heartbeat_s``, so writers growing at once may overshoot by what they store in that time.
The pool quota (``sharing.quota_loop``) sets ``grow_limit_bytes`` and evicts old pages on top of it.

Write order of a put batch (the crash rule each phase relies on is at its code):
    1. reserve   under the lock: admit each page, take a slot and a ``seq`` (evicting as needed: the
                 victims' DEL records are appended before their slots are overwritten)
    2. write     no lock: page and trailer in one IO per slot; fdatasync (durability ``batch``/``always``)
    3. publish   under the lock: append the PUT records and make the pages visible, in one section
    4. persist   fsync the journal (unless durability is ``none``; always under ``sharing = "cluster"``,
                 where other hosts see only synced records): only then is the batch acknowledged;
                 checkpoint when enough records piled up
A record never points at bytes not written, and a page is visible only once written; its trailer and its
PUT record carry the same ``seq``. Under ``always`` each page is its own batch.

On a shared raw pool (``host_index``) the meta lives in the region's areas
(``media.shared_raw.region_meta``) and each lease beat also beats the host lease, whose takeover by another
machine fences the store. A journal area is bounded: a batch that would not fit is refused
(``put_no_space``), a checkpoint is due at half full, and a generation whose area the durable checkpoint
does not cover yet is preceded by a checkpoint in place (``checkpoint``).

Open order: ``store.writer_open``. Close order: checkpoint -> lease (its thread ends) -> host lease ->
journal -> engine (its threads end) -> devices -> writer lock, each step attempted whatever an earlier one
raised; the first failure is raised after as ``StoreCloseError`` (``store.lifecycle``). A failed checkpoint
never loses an acknowledged page: the next open replays the journals the last good checkpoint does not cover.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from sgl_kvtier.config import Durability, Sharing, StoreConfig
from sgl_kvtier.io.buffers import Run
from sgl_kvtier.io.engine import IOEngine
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.policy.admission import AdmissionFilter
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store import journal_write as jw
from sgl_kvtier.store.capacity import CapacitySide
from sgl_kvtier.store.layout import Layout
from sgl_kvtier.store.lifecycle import Acquired, Step
from sgl_kvtier.store.meta import WriterJournal, writer_meta
from sgl_kvtier.store.parts import Checksum
from sgl_kvtier.store.shard import PageShard, SharedTelemetry
from sgl_kvtier.store.site import Claim, Closeable, Heartbeat, WriterSite
from sgl_kvtier.store.transfer import SlotIdentity
from sgl_kvtier.store.writer_open import acquire_writer


@dataclass
class _PutBatch:
    """One put batch between its phases."""

    results: list[bool]
    reserved: list[tuple[int, int, int]] = field(default_factory=list)  # (page index, slot, seq) to write


JOURNAL_SLACK = 16 << 10  # a bounded journal keeps this much for the DELs and TOUCHes outside put batches


class PageStore(PageShard, CapacitySide):
    """The writer of one namespace shard: put / delete / clear / checkpoint over the shared read path."""

    # Why this store writes nothing more in its directory, or None (set by the pool): a live writer of another
    # host retired it (``sharing.retire``; the directory is being deleted), or its descriptors are lost
    # (``store.lost_handles``: its filesystem's client died). Fenced: puts refused without IO, no checkpoint;
    # the pool replaces it with a writer in a fresh directory (``sharing.fencing``).
    fenced: str | None = None

    def __init__(self, config: StoreConfig, namespace: Namespace, layout: Layout, claim: Claim,
                 recovered: jr.Recovered, engine: IOEngine, journal: WriterJournal, *,
                 shared: SharedTelemetry | None = None, clock: Callable[[], float] | None = None):
        self.incarnation = os.urandom(16)  # new per open: slot trailers and the lease name it
        super().__init__(config, namespace, layout, recovered, layout.capacity_slots, engine,
                         identity=SlotIdentity(namespace.digest(), self.incarnation), shared=shared)
        self.claim = claim
        self.wid = claim.wid
        self.lease: Heartbeat | None = None  # started by ``open`` (``WriterSite.start_lease``)
        self.clock: Callable[[], float] = time.monotonic if clock is None else clock  # page ages, the quota
        if clock is not None:
            self._index.use_clock(clock)
        self.grow_limit_bytes: int | None = None  # the quota's growth limit (``sharing.quota_loop``)
        self.published: tuple[float, dict[str, Any]] | None = None  # (clock, fields) of the last ``usage()``
        # The other writers' leased bytes (``sharing.pool`` sets it); called under the lock, so it must be cheap.
        self.peer_bytes: Callable[[], int] = lambda: 0
        self._touched: dict[PageKey, float] = {}  # remote pages whose use was journaled, and when
        self._checkpoint_lock = threading.Lock()
        self._admission = AdmissionFilter(config.admission_threshold)
        self._inflight: set[PageKey] = set()  # reserved, not yet published: a second put of one is "present"
        self._seq = recovered.seq
        self._journal = journal
        self._meta = writer_meta(layout.files, layout.meta)
        self._host: Closeable | None = None  # a shared raw pool's host lease (``WriterSite.start_lease``)
        self.host_check: Callable[[], str | None] | None = None  # why another machine took the host slot

    # ------------------------------------------------------------------ open / close
    @classmethod
    def open(cls, config: StoreConfig, namespace: Namespace, *, site: WriterSite, engine: IOEngine | None = None,
             shared: SharedTelemetry | None = None, wid: str | None = None,
             clock: Callable[[], float] | None = None) -> PageStore:
        """Open (creating if needed) the shard of ``namespace`` on ``config.devices`` as one of its writers,
        in the place ``site`` claims (a directory medium: the lowest free writer directory of this host).
        Callers use ``sharing.sites.open_writer``. ``engine`` (tests): the base engine to run IO on, the
        store's from this call on (closed by ``close``, or here if this fails). ``shared``: counters,
        breakers and read rates shared with a pool's other shards. ``wid``: open that existing writer place
        of this host only (a dead writer's, to reclaim its space; StoreLockedError if its lock is held).
        ``clock``: the clock of page ages (tests inject one; default monotonic).

        Raises: ConfigError, DeviceError, StoreFormatError, StoreLockedError (``sharing = "off"`` and the
        directory is held; or a live writer of the namespace runs under the other kind of mode, one sole
        and one shared: ``sharing.writers.SharingModeError``), OSError (the fold below). A failed open has
        released everything it took, the writer lock last (``store.lifecycle``).
        """
        with Acquired(f"a writer of {namespace.dirname()}") as held:
            store = acquire_writer(config, namespace, site, held, engine, wid,
                                   partial(cls, config, namespace, shared=shared, clock=clock))
            held.hand_over(store._release_steps())  # the store's own release steps, from here on
            if store.recovery.replayed_records or store.recovery.problems:
                store.checkpoint()  # fold what was replayed (and drop torn journals) so the next open is fast
            store.lease, store._host, store.host_check = site.start_lease(store)
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
        # A fenced store writes no checkpoint: its directory is being deleted (a file made then would outlive it),
        # or its descriptors are lost.
        return [*([] if self.fenced else [("checkpoint", self.checkpoint)]), *self._release_steps()]

    def _release_steps(self) -> list[Step]:
        # Crash rule: the writer lock goes last, once every file of the shard is closed, so the next writer
        # never overlaps a descriptor of this one; the lease thread ends first (it reads the journal), then
        # the journal (nothing is appended after).
        return [("lease", self._close_lease), ("host lease", self._close_host), ("journal", self._close_journal),
                *super()._release_steps(), ("writer lock", self.claim.release)]

    def _close_lease(self) -> None:
        lease, self.lease = self.lease, None  # detached first: closed once
        if lease is not None:
            lease.close()

    def _close_host(self) -> None:
        host, self._host = self._host, None
        if host is not None:
            host.close()

    def _close_journal(self) -> None:
        self._journal.close()  # late-bound: ``checkpoint`` replaces the journal

    # ------------------------------------------------------------------ put
    def put(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]], parent: PageKey | None = None) -> list[bool]:
        """Store pages; ``parent`` is the key that ``keys[0]`` chains on (for chain-aware eviction), and
        each later page chains on the key before it."""
        self._check_open()
        if self.fenced is not None:  # retired or lost (``fenced``): refused without IO (the pool counts it)
            return [False] * len(keys)
        if self.config.durability is Durability.ALWAYS and len(keys) > 1:
            return [ok for i in range(len(keys))
                    for ok in self.put(keys[i:i + 1], pages[i:i + 1], keys[i - 1] if i else parent)]
        batch = self._reserve(keys, pages)
        if batch.reserved:
            checksums = self._write(keys, pages, parent, batch)
            due = self._publish(keys, parent, batch, checksums)
            self._persist(due)
        return batch.results

    def _reserve(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]]) -> _PutBatch:
        """Phase 1 (under the lock): admit each page and give it a slot, evicting as needed."""
        batch = _PutBatch([True] * len(keys))
        evicted: list[bytes] = []
        with self._lock:
            room = self._journal.room()
            if room is not None and room < JOURNAL_SLACK + 2 * (len(keys) + 1) * jw.record_estimate(self._index.parts):
                self.counters.put_no_space += len(keys)  # a bounded journal (a region's area) nearly full
                return _PutBatch([False] * len(keys))
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
                    self._seq += 1  # the page's seq: its trailer (phase 2) and its PUT record (phase 3)
                    batch.reserved.append((i, slot, self._seq))
            # Crash rule: a victim's DEL goes to the journal before phase 2 overwrites its slot. It is not
            # synced yet; if a crash loses it, replay maps the victim to bytes of another page, which fail
            # the victim's checksum: a miss, never wrong KV.
            try:
                self._journal.append(evicted)
            except BaseException:  # nothing of the batch was written: its slots and keys are free again
                for i, slot, _ in batch.reserved:
                    self._inflight.discard(keys[i])
                    self._slots.release(slot)
                raise
        return batch

    def _write(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]], parent: PageKey | None,
               batch: _PutBatch) -> list[Checksum | None]:
        """Phase 2 (no lock): write the reserved pages (each with its trailer); per page its checksums, or
        None where it failed."""
        # Crash rule: the data is written and (durability batch/always) fdatasync'd here, before phase 3
        # appends any record naming it, so a replayed record never points at unwritten bytes.
        return self._io.write([(pages[i], slot, keys[i], keys[i - 1] if i > 0 else parent, seq)
                               for i, slot, seq in batch.reserved])

    def _publish(self, keys: Sequence[PageKey], parent: PageKey | None, batch: _PutBatch,
                 checksums: list[Checksum | None]) -> bool:
        """Phase 3 (under the lock): journal and publish the written pages, free the slots of failed ones.
        True when a checkpoint is due."""
        records: list[bytes] = []
        written: list[tuple[int, int, Checksum]] = []
        with self._lock:
            for (i, slot, seq), checksum in zip(batch.reserved, checksums):
                self._inflight.discard(keys[i])
                if checksum is None:
                    batch.results[i] = False
                    self._slots.release(slot)
                    continue
                records.append(jw.put_record(seq, keys[i], slot, checksum, keys[i - 1] if i > 0 else parent))
                written.append((i, slot, checksum))
            # Crash rule: records are appended in the section that publishes their pages, so the journal's
            # order is the order readers saw (a later DEL of a page can never precede its PUT).
            try:
                self._journal.append(records)
            except OSError:  # a bounded journal full (a region's area): not stored, a checkpoint is due
                for i, slot, _ in written:
                    batch.results[i] = False
                    self._slots.release(slot)
                self.counters.put_no_space += len(written)
                return True
            for i, slot, checksum in written:
                self._index.add(keys[i], slot, checksum, keys[i - 1] if i > 0 else parent)
                self.counters.put_pages += 1
                self.counters.bytes_written += self.page_bytes
            return self._journal.records >= self.config.checkpoint_interval or self._journal.nearly_full

    def _persist(self, checkpoint_due: bool) -> None:
        """Phase 4 (no lock): make the batch's records durable, then checkpoint if one is due."""
        if self._journal_sync_due():
            self._journal.sync()  # crash rule: the batch is acknowledged (put returns) only after this
        if checkpoint_due:
            self.checkpoint()

    def _journal_sync_due(self) -> bool:
        """Whether a batch's journal records are fsynced before it returns (puts, deletes, evictions)."""
        # Rule (sharing = "cluster"): always, also under durability = "none". Other hosts see appends only once
        # they reach the shared filesystem's server (NFS: not before an fsync or a close), and they read each
        # journal up to the length its lease announced: an unsynced batch would be invisible or torn there.
        return self.config.durability is not Durability.NONE or self.config.sharing is Sharing.CLUSTER

    # ------------------------------------------------------------------ delete / maintenance
    def _drop(self, key: PageKey, records: list[bytes]) -> None:
        """Forget a page (under the lock) and add its DEL record to ``records``."""
        self._remove(key)
        records.append(self._del_record(key))

    def _dropped(self, keys: list[PageKey]) -> None:
        try:
            self._journal.append([self._del_record(key) for key in keys])
        except OSError:  # a full journal area: replay may map them again, and they fail their checksum again
            return

    def _del_record(self, key: PageKey) -> bytes:
        self._seq += 1
        return jw.del_record(self._seq, key)

    def delete(self, keys: Sequence[PageKey]) -> int:
        """Drop the stored pages among ``keys``; how many were dropped (durable unless durability is none)."""
        return self._drop_keys(keys, evicting=False)

    def evict(self, keys: Sequence[PageKey]) -> int:
        """Evict own pages by key (the pool quota's choice; others' keys are ignored); how many went."""
        return self._drop_keys(keys, evicting=True)

    def _drop_keys(self, keys: Sequence[PageKey], evicting: bool) -> int:
        self._check_open()
        records: list[bytes] = []
        with self._lock:
            for key in keys:
                if key in self._index:
                    self._drop(key, records)
            if evicting:
                self.counters.evictions += len(records)
            self._journal.append(records)
        if records and self._journal_sync_due():
            self._journal.sync()
        return len(records)

    def clear(self) -> int:
        """Drop every page; how many were dropped."""
        with self._lock:
            keys = list(self._index.slot_of)
        return self.delete(keys)

    def checkpoint(self) -> None:
        """Snapshot the index into the checkpoint and start a new journal generation.

        Crash rule: the snapshot and the rotation happen in one lock section, so the checkpoint covers
        exactly the journals below the new generation; ``write_checkpoint`` replaces it atomically and only
        then are those journals deleted (a crash leaves the old checkpoint with all its journals). A region
        whose next journal area holds a generation the durable checkpoint does not cover (earlier
        checkpoints failed) first checkpoints in place: covering the generations below the current one with
        a snapshot that already holds some of the current one's records (replaying those again over it
        changes nothing: each key ends as its last record in the journal left it), then rotates.
        """
        if self.fenced is not None:  # retired (its directory is being deleted) or lost
            return
        with self._checkpoint_lock:
            for _ in range(2):
                with self._lock:
                    snapshot = self._index.snapshot()
                    seq = self._seq
                    old = self._journal
                    old.sync()
                    generation = old.generation + 1
                    rotate = self._meta.may_rotate(generation)
                    if rotate:
                        self._journal = self._meta.open_journal(generation)
                        old.close()
                    else:
                        generation = old.generation
                self._meta.write_checkpoint(jw.checkpoint_blob(*snapshot, seq, generation), generation)
                if rotate:
                    return
