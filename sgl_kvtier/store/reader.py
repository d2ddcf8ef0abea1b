"""PageReader: a read-only view of a namespace shard that follows its live writer.

Opened without the writer lock and without creating anything: the index comes from the shard's checkpoint
plus its journals (``journal.recover``), and ``refresh()`` replays what the writer appended since
(``journal.follow``: a stat or two when nothing changed). Used by the MLA ranks that read the one shard
SGLang's writer rank writes, and by ``sgl-kvtier inspect`` / ``fsck``.

Rules (so that any number of readers can follow a writer, in any processes):
  * A reader never writes a file and never takes the lock: not the journal, not the checkpoint.
  * A reader's view may lag its writer. A page the writer dropped since may still be listed; its slot is
    then either unchanged (the old page's bytes, still good) or rewritten (they fail the old checksum: a
    miss, and the reader drops the page from its own view). Never wrong KV.
  * Its capacity is whatever the shard holds: every recovered page is shown, whatever the limit is now.
  * A reader never evicts or allocates a slot, so its eviction policy need not see the writer's new pages;
    pins still keep its own reads consistent.

Its state is one followed journal (``recovery``, whose dicts the index shares and replay updates in
place). Following several writers' shards would give a reader one such state per writer.
"""

from __future__ import annotations

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.io.engine import IOEngine
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store.index import PageIndex
from sgl_kvtier.store.layout import Layout, meta_dir, open_layout
from sgl_kvtier.store.lifecycle import Acquired
from sgl_kvtier.store.shard import PageShard, collector_paused, open_shard_engine, own_engine
from sgl_kvtier.store.slots import SlotTable


def _capacity(layout: Layout, recovered: jr.Recovered, at_least: int = 0) -> int:
    """Room for every slot ``recovered`` uses, and at least the layout's (or ``at_least``) slots."""
    return max([layout.capacity_slots, at_least, *(s + 1 for s in recovered.key_of)])


class PageReader(PageShard):
    """A read-only, following view of one namespace shard (see the module docstring)."""

    def __init__(self, config: StoreConfig, namespace: Namespace, layout: Layout, recovered: jr.Recovered,
                 engine: IOEngine):
        super().__init__(config, namespace, layout, recovered, _capacity(layout, recovered), engine)

    @classmethod
    def open(cls, config: StoreConfig, namespace: Namespace, *, engine: IOEngine | None = None) -> PageReader:
        """Open the existing shard of ``namespace`` on ``config.devices`` read-only. ``engine`` (tests): the
        base engine to run IO on, the reader's from this call on (closed by ``close``, or here if this fails).

        Raises: DeviceError (no such shard yet, among others), ConfigError, StoreFormatError. A failed open
        has released everything it took (``store.lifecycle``).
        """
        with Acquired(f"a reader of {namespace.dirname()}") as held:
            place = own_engine(held, engine)
            meta = meta_dir(config, namespace)
            layout = open_layout(config, namespace, meta, create=False)
            held.push("devices", layout.close)
            io_engine = open_shard_engine(config, engine, held, place)
            with collector_paused():
                return cls(config, namespace, layout, jr.recover(meta), io_engine)

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
