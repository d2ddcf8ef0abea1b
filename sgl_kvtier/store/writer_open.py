"""Taking what a writer's ``PageStore`` is built on, in the open order, each piece through its ``WriterSite``.

Open order: the sharing mode's storage checks (nothing made yet) -> claim (a writer directory or shared raw
region, with its lock) -> the meta-present check -> layout (created if needed) -> CONFIG -> engine ->
recover -> a new journal generation (never appending to an old one) -> the first segments made ahead
(``Arena.prepare``) -> the store built on them; then
``PageStore.open`` folds what was replayed and starts the lease. Each resource is pushed on the open's
``Acquired`` stack (``store.lifecycle``) as soon as it is taken, so an open failing at any step releases
what it took, newest first, the writer lock last. The crash rule each step relies on is at its code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.io.engine import IOEngine
from sgl_kvtier.keys import Namespace
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store import journal_write as jw
from sgl_kvtier.store.index import PageIndex
from sgl_kvtier.store.layout import Layout
from sgl_kvtier.store.lifecycle import Acquired
from sgl_kvtier.store.meta import WriterJournal, writer_meta
from sgl_kvtier.store.shard import collector_paused, open_shard_engine, own_engine
from sgl_kvtier.store.site import Claim, WriterSite

T = TypeVar("T")
Build = Callable[[Layout, Claim, jr.Recovered, IOEngine, WriterJournal], T]


def acquire_writer(config: StoreConfig, namespace: Namespace, site: WriterSite, held: Acquired,
                   engine: IOEngine | None, wid: str | None, build: Build[T]) -> T:
    """Take, in the open order (module docstring), everything a writer of ``namespace`` is made of, each
    pushed on ``held``; ``build(layout, claim, recovered, engine, journal)`` makes the store of them (while
    the collector is paused, as recovery is). ``engine``: the injected base engine (the store's from here
    on); ``wid``: that existing writer directory of this host only. Raises what ``PageStore.open`` raises."""
    place = own_engine(held, engine)
    site.check_storage()  # what the sharing mode needs of the storage, before any file is made
    ns_meta = site.meta_dir(namespace)
    # First file: nothing of the directory (or region) is touched without it.
    claim = site.claim(namespace, ns_meta, wid)
    held.push("writer lock", claim.release)
    site.check_meta_present(namespace, claim.path, claim.wid)
    layout = site.open_layout(namespace, ns_meta, claim.wid, create=True)
    held.push("devices", layout.close)
    meta = writer_meta(layout.files, layout.meta)
    meta.save_config(config)
    io_engine = open_shard_engine(config, engine, held, place)
    with collector_paused():
        recovered = jr.recover(layout.meta, len(namespace.part_sizes()), view=meta.view)
        jr.drain_touched(recovered)  # its own uses of others' pages: nothing to its own index
        if not meta.may_rotate(recovered.generation):  # a region's area its checkpoint does not cover
            fold = PageIndex(recovered, config.eviction, layout.capacity_slots).snapshot()
            meta.write_checkpoint(jw.checkpoint_blob(*fold, recovered.seq, recovered.generation),
                                  recovered.generation)
        # A new generation: a torn tail of an earlier run stays where that file's replay stops.
        journal = meta.open_journal(recovered.generation)
        held.push("journal", journal.close)
        # Crash rule: segments are made ahead only now that the journal exists, so a crash never leaves a
        # writer directory with segments but neither journal nor checkpoint (``check_meta_present``).
        layout.prepare()
        return build(layout, claim, recovered, io_engine, journal)
