"""PageReader: a read-only view of one writer's pages of a namespace shard, following that live writer.

Opened without the writer lock and without creating anything: the index comes from the writer directory's
checkpoint plus its journals (``journal.recover``), and ``refresh()`` replays what the writer appended
since (``journal.follow``: a stat or two when nothing changed). ``wid`` picks the writer directory
(``w-<wid>``); without one, the lowest present. Used by ``store.pool.SharedPool`` (one per other writer),
and by ``sgl-kvtier inspect`` / ``fsck``.

Rules (so that any number of readers can follow a writer, in any processes):
  * A reader never writes a file and never takes the lock: not the journal, not the checkpoint.
  * A reader's view may lag its writer. A page the writer dropped since may still be listed; its slot is
    then either unchanged (the old page's bytes, still good) or rewritten (they fail the old checksum: a
    miss, and the reader drops the page from its own view). Never wrong KV.
  * Its capacity is whatever the shard holds: every recovered page is shown, whatever the limit is now.
  * A reader never evicts or allocates a slot, so its eviction policy need not see the writer's new pages;
    pins still keep its own reads consistent.

  * A reader of a peer (``follows_peer``, the pool's) re-reads the journal when a read fails its checksum,
    and counts a page whose mapping changed meanwhile as ``remote_reuse_races``, not as corruption. A
    writer directory that vanishes (or whose segments go) leaves an empty view: misses, never errors.

Its state is one followed journal (``recovery``, whose dicts the index shares and replay updates in
place); the pool keeps one reader per other writer.
"""

from __future__ import annotations

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import DeviceError
from sgl_kvtier.io.engine import IOEngine
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store.index import PageIndex
from sgl_kvtier.store.layout import Layout, meta_dir, open_layout
from sgl_kvtier.store.lifecycle import Acquired
from sgl_kvtier.store.shard import PageShard, SharedTelemetry, collector_paused, open_shard_engine, own_engine
from sgl_kvtier.store.slots import SlotTable
from sgl_kvtier.store.writers import writer_dirs


def _capacity(layout: Layout, recovered: jr.Recovered, at_least: int = 0) -> int:
    """Room for every slot ``recovered`` uses, and at least the layout's (or ``at_least``) slots."""
    return max([layout.capacity_slots, at_least, *(s + 1 for s in recovered.key_of)])


class PageReader(PageShard):
    """A read-only, following view of one namespace shard (see the module docstring)."""

    def __init__(self, config: StoreConfig, namespace: Namespace, layout: Layout, recovered: jr.Recovered,
                 engine: IOEngine, *, shared: SharedTelemetry | None = None, follows_peer: bool = False):
        super().__init__(config, namespace, layout, recovered, _capacity(layout, recovered), engine, shared=shared)
        self.follows_peer = follows_peer
        self.wid = layout.wid

    @classmethod
    def open(cls, config: StoreConfig, namespace: Namespace, *, wid: str | None = None,
             engine: IOEngine | None = None, shared: SharedTelemetry | None = None,
             follows_peer: bool = False) -> PageReader:
        """Open writer ``wid``'s pages of the shard of ``namespace`` read-only (``wid`` None: the lowest
        writer directory present). ``engine`` (tests): the base engine to run IO on, the reader's from this
        call on (closed by ``close``, or here if this fails). ``shared``/``follows_peer``: a pool's.

        Raises: DeviceError (no such shard or writer yet, among others), ConfigError, StoreFormatError. A
        failed open has released everything it took (``store.lifecycle``).
        """
        with Acquired(f"a reader of {namespace.dirname()}") as held:
            place = own_engine(held, engine)
            ns_meta = meta_dir(config, namespace)
            if wid is None:
                present = writer_dirs(ns_meta)
                if not present:
                    raise DeviceError(f"{ns_meta}: no store here (no writer has made it yet)")
                wid = present[0][0]
            layout = open_layout(config, namespace, ns_meta, wid, create=False)
            held.push("devices", layout.close)
            io_engine = open_shard_engine(config, engine, held, place)
            with collector_paused():
                recovered = jr.recover(layout.meta, len(namespace.part_sizes()))
                return cls(config, namespace, layout, recovered, io_engine, shared=shared, follows_peer=follows_peer)

    def _before_corrupt(self) -> None:
        if self.follows_peer:
            self.refresh()

    def refresh(self) -> bool:
        """Pick up pages the live writer (another process) added or dropped since; True if anything changed."""
        with self._lock:
            changed = jr.follow(self.layout.meta, self.recovery)
            # Replayed records land in place in the dicts the index shares with ``self.recovery``; only a
            # restart from a new checkpoint replaces them, and only then is the index rebuilt.
            if changed and self.recovery.slot_of is not self._index.slot_of:
                capacity = _capacity(self.layout, self.recovery, self._slots.capacity)
                self._index = PageIndex(self.recovery, self.config.eviction, capacity)
                slots = SlotTable(capacity, self._index.slots())
                slots.carry_pins(self._slots)  # reads in flight unpin their slots in the new table
                self._slots = slots
            return changed

    def _dropped(self, keys: list[PageKey]) -> None:
        # Kept to this reader: the shard is the writer's; it finds the page bad on its own next read of it.
        return None
