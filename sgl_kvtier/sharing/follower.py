"""PageReader: a read-only view of one writer's pages of a namespace shard, following that live writer.

Opened without the writer lock and creating nothing: the index is the writer's checkpoint plus its journals
(``store.journal.recover``), and ``refresh()`` replays what the writer appended since (``store.journal.follow``).
``wid`` picks the writer (default: the lowest present). Used by ``sharing.pool.SharedPool`` (one per other
writer) and by ``sgl-kvtier inspect`` / ``fsck``.

Rules (any number of readers may follow a writer, in any processes):
  * A reader never writes a file and never takes the lock, never evicts nor allocates a slot.
  * Its view may lag: a page dropped since may still be listed; its slot then holds the old bytes (good) or
    new ones (failing the old checksum: a miss, dropped from the view). Never wrong KV.
  * A peer's reader (``follows_peer``) re-reads the journal when a read fails its checksum and counts a
    changed mapping as ``remote_reuse_races``; a vanished directory leaves an empty view, never errors.
  * A peer's reader first reads a page failing verification again through a fresh descriptor of its
    segment (reopened at most once per segment per ``follow_interval_s``, ``store.renewal``): on some
    shared filesystems a descriptor opened before another host rewrote a slot keeps the old bytes.
``sharing = "cluster"`` (a shared filesystem whose clients may see each other's files stale):
  * Each refresh reads the LEASE and replays only as far as the leases announced
    (``store.journal.follow_announced``). A stale lease never moves the view back; a lease of a new incarnation
    announcing less than the cursor (a new writer in the directory) starts over from its checkpoint.
  * A page dropped for failing its checksum may have been a stale read, so it is kept as a *suspect* and
    put back after 1, 2, 4, 8 of its writer's beats (then dropped for good), unless a replayed record named
    its key or slot since (``Recovered.watch``). Every try is a verified read.
  * Files are read through an ``io.file_view.FileView`` (``open``'s ``view``, else ``reading_through``'s).
A shared raw pool's writer is read through its region's ``media.shared_raw.region_meta.RegionFiles``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_kvtier.config import Sharing, StoreConfig
from sgl_kvtier.errors import CorruptRecordError, DeviceError
from sgl_kvtier.io.engine import IOEngine
from sgl_kvtier.io.file_view import POSIX, FileView
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.sharing import sites
from sgl_kvtier.sharing.writers import writer_dirs
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store.format import writer_dirname
from sgl_kvtier.store.index import PageIndex
from sgl_kvtier.store.layout import Layout
from sgl_kvtier.store.lifecycle import Acquired
from sgl_kvtier.store.meta import LEASE
from sgl_kvtier.store.parts import Checksum
from sgl_kvtier.store.renewal import DescriptorRenewal
from sgl_kvtier.store.shard import PageShard, SharedTelemetry, collector_paused, open_shard_engine, own_engine
from sgl_kvtier.store.slots import SlotTable

SUSPECT_TRIES = 4  # a suspect page is put back after 1, 2, 4, 8 beats of its writer, then dropped for good
SUSPECT_LIMIT = 4096  # suspects kept at most (the oldest go first)
_view: FileView = POSIX  # what readers opened without a ``view`` read files through


@contextmanager
def reading_through(view: FileView) -> Iterator[FileView]:
    """Readers opened inside the block (a pool's peers too) read their writers' files through ``view``."""
    global _view
    previous, _view = _view, view
    try:
        yield view
    finally:
        _view = previous


def read_lease(view: FileView, path: Path) -> dict[str, Any] | None:
    """``sharing.lease.read_lease`` through ``view``: the lease in ``path``, or None (missing, no valid block)."""
    try:
        return fmt.unpack_lease(view.read(path, 0, 2 * fmt.LEASE_BLOCK_BYTES), str(path))
    except (OSError, CorruptRecordError):
        return None


def _announced_cursor(lease: dict[str, Any] | None) -> tuple[int, int] | None:
    cursor = None if lease is None else lease.get("journal")
    if isinstance(cursor, list | tuple) and len(cursor) == 2 and all(isinstance(x, int) and x >= 0 for x in cursor):
        return int(cursor[0]), int(cursor[1])
    return None


def _capacity(layout: Layout, recovered: jr.Recovered, at_least: int = 0) -> int:
    """Room for every slot ``recovered`` uses, and at least the layout's (or ``at_least``) slots."""
    return max([layout.capacity_slots, at_least, *(s + 1 for s in recovered.key_of)])


@dataclass
class _Suspect:
    slot: int
    checksum: Checksum  # ``store.parts``: an int for one part, packed u64s for several
    tries: int
    due: int  # the beat count at which it goes back into the view
    out: bool = True  # dropped from the view now


class PageReader(PageShard):
    """A read-only, following view of one namespace shard (see the module docstring)."""

    def __init__(self, config: StoreConfig, namespace: Namespace, layout: Layout, recovered: jr.Recovered,
                 engine: IOEngine, *, shared: SharedTelemetry | None = None, follows_peer: bool = False,
                 view: FileView = POSIX, lease: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(config, namespace, layout, recovered, _capacity(layout, recovered), engine, shared=shared)
        self.follows_peer = follows_peer
        if follows_peer:  # a live writer on another host may rewrite slots under descriptors held here
            self._io.renewal = DescriptorRenewal(layout, self.counters, config.follow_interval_s, clock)
        self.wid = layout.wid
        self.cluster = config.sharing is Sharing.CLUSTER
        self.view = view
        self.lease: dict[str, Any] | None = None  # cluster: the last lease read
        self.announced: dict[int, int] = {}  # cluster: generation -> most journal bytes its leases announced
        self.beats = 0  # cluster: how many times the writer's lease was seen to advance
        self._marks: dict[bytes, int] = {}  # incarnation -> highest lease counter seen
        self._suspects: dict[PageKey, _Suspect] = {}
        if self.cluster:
            self._take_lease(lease)

    @classmethod
    def open(cls, config: StoreConfig, namespace: Namespace, *, wid: str | None = None,
             engine: IOEngine | None = None, shared: SharedTelemetry | None = None,
             follows_peer: bool = False, view: FileView | None = None,
             clock: Callable[[], float] = time.monotonic) -> PageReader:
        """Open writer ``wid``'s pages of the shard of ``namespace`` read-only (``wid`` None: the lowest
        writer directory present). ``engine`` (tests): the base engine to run IO on, the reader's from this
        call on (closed by ``close``, or here if this fails). ``shared``/``follows_peer``: a pool's.
        ``view``: how its writer's files are seen (None: the module's default, ``reading_through``).
        ``clock``: what times a peer's descriptor renewals (``store.renewal``).

        Raises: DeviceError (no such shard or writer yet, among others), ConfigError, StoreFormatError. A
        failed open has released everything it took (``store.lifecycle``).
        """
        view = _view if view is None else view
        with Acquired(f"a reader of {namespace.dirname()}") as held:
            place = own_engine(held, engine)
            site = sites.site_for(config)
            ns_meta = site.meta_dir(namespace)
            raw = config.host_index is not None  # a shared raw pool: regions, read through their own view
            if wid is None:
                present = [w for w, path in writer_dirs(ns_meta) if raw or view.exists(path)]
                if not present:
                    raise DeviceError(f"{ns_meta}: no store here (no writer has made it yet)")
                wid = present[0]
            elif not raw and not view.exists(ns_meta / writer_dirname(wid)):
                raise DeviceError(f"{ns_meta / writer_dirname(wid)}: not there (yet)")
            layout = site.open_layout(namespace, ns_meta, wid, create=False)
            held.push("devices", layout.close)
            view = view if layout.files is None else layout.files.view
            io_engine = open_shard_engine(config, engine, held, place)
            lease, bounds = None, None
            if config.sharing is Sharing.CLUSTER:
                lease = read_lease(view, layout.meta / LEASE)
                cursor = _announced_cursor(lease)
                bounds = {} if cursor is None else {cursor[0]: cursor[1]}
            with collector_paused():
                parts = len(namespace.part_sizes())
                recovered = jr.recover(layout.meta, parts) if bounds is None and view is POSIX else \
                    jr.recover(layout.meta, parts, view=view, announced=bounds)  # (host mode, plain view: as always)
                return cls(config, namespace, layout, recovered, io_engine, shared=shared,
                           follows_peer=follows_peer, view=view, lease=lease, clock=clock)

    def _before_corrupt(self) -> None:
        if self.follows_peer:
            self.refresh()

    def refresh(self) -> bool:
        """Pick up pages the live writer (another process) added or dropped since; True if anything changed."""
        with self._lock:
            if self.cluster:
                changed = self._follow_lease()
            else:
                changed = jr.follow(self.layout.meta, self.recovery, self.view)
            # Replayed records land in place in the dicts the index shares with ``self.recovery``; only a
            # restart from a new checkpoint replaces them, and only then is the index rebuilt.
            if changed and self.recovery.slot_of is not self._index.slot_of:
                capacity = _capacity(self.layout, self.recovery, self._slots.capacity)
                self._index = PageIndex(self.recovery, self.config.eviction, capacity)
                slots = SlotTable(capacity, self._index.slots())
                slots.carry_pins(self._slots)  # reads in flight unpin their slots in the new table
                self._slots = slots
            return self._reinstate() or changed

    # ------------------------------------------------------------------ cluster: what the writer announced
    def _take_lease(self, lease: dict[str, Any] | None) -> tuple[int, int] | None:
        """Note what ``lease`` announced; its journal cursor, or None where it announces nothing new to
        follow (none, or a stale one: of an incarnation older than the newest seen). Under the lock."""
        cursor = _announced_cursor(lease)
        if lease is None or cursor is None:
            return None
        incarnation, counter = bytes(lease.get("incarnation") or b""), int(lease.get("counter", 0))
        seen = self._marks.get(incarnation)
        if seen is not None and incarnation != next(reversed(self._marks)):
            return None
        if seen is None or counter > seen:
            self.beats += 1
            self._marks[incarnation] = counter
        if seen is None and len(self._marks) > 1 and cursor < self.recovery.cursor:
            # A new incarnation announcing less than this view holds: a new writer in the directory.
            self.announced = {}
            self.recovery.__dict__.update(
                jr.recover(self.layout.meta, self.recovery.parts, view=self.view, announced={}).__dict__)
        self.lease = lease
        gen, size = cursor
        self.announced[gen] = max(self.announced.get(gen, 0), size)
        return cursor

    def _follow_lease(self) -> bool:
        before = self.recovery.slot_of
        if self._take_lease(read_lease(self.view, self.layout.meta / LEASE)) is None:
            return False
        changed = jr.follow_announced(self.layout.meta, self.recovery, self.announced, self.view)
        for gen in [g for g in self.announced if g < self.recovery.cursor[0]]:
            del self.announced[gen]
        return changed or self.recovery.slot_of is not before

    # ------------------------------------------------------------------ cluster: suspect pages
    def _remove(self, key: PageKey) -> None:
        entry = self._index.lookup(key) if self.cluster and self.follows_peer else None
        super()._remove(key)
        if entry is None:
            return
        slot, checksum = entry
        old = self._suspects.pop(key, None)
        tries = old.tries + 1 if old is not None and (old.slot, old.checksum) == entry else 1
        if tries > SUSPECT_TRIES:
            return
        for other in [k for k, s in self._suspects.items() if s.slot == slot]:
            del self._suspects[other]  # one suspect per slot: the latest page the view had there
        self._suspects[key] = _Suspect(slot, checksum, tries, self.beats + (1 << (tries - 1)))
        self.recovery.watch.update((key, slot))
        while len(self._suspects) > SUSPECT_LIMIT:
            self._suspects.pop(next(iter(self._suspects)))

    def _reinstate(self) -> bool:
        """Put back the suspects that are due and that no record replayed since has named. Under the lock."""
        back, watch = False, self.recovery.watch
        if not self._suspects:
            watch.clear()
            return False
        for key, s in list(self._suspects.items()):
            if not s.out:
                if self._index.lookup(key) != (s.slot, s.checksum):
                    del self._suspects[key]  # the journal moved it since: no longer ours to watch
                continue
            if key not in watch or s.slot not in watch or key in self._index or s.slot in self._index.key_of:
                del self._suspects[key]  # a record replayed since decides about it
                continue
            if self.beats >= s.due:
                self._index.add(key, s.slot, s.checksum, None)
                s.out, back = False, True
        watch.clear()
        watch.update(x for key, s in self._suspects.items() if s.out for x in (key, s.slot))
        return back

    def _dropped(self, keys: list[PageKey]) -> None:
        # Kept to this reader: the shard is the writer's; it finds the page bad on its own next read of it.
        return None
