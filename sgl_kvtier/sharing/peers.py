"""The other writers a pool follows (``sharing.pool``), and when a shard may be closed under concurrent calls.

``Peers``: one read-only ``PageReader`` per other writer of the namespace.
  * Discovered lazily: a new directory is opened on the next ``refresh``; one failing to open is tried again
    after PEER_RETRY_S; one judged ``RETIRED`` is never opened.
  * Each ``refresh`` (at most every ``follow_interval_s`` unless forced; ``shortfall``: a lookup that fell
    short, by ``sharing.shortfall``'s rule: a retry always, any other at most every quarter of that, waiting
    up to SHORTFALL_WAIT_S for a refresh elsewhere) reads every peer's lease and fence
    (``LeaseWatch.retired``: the FENCE only, no LOCK probe), replays its journal and hands the TOUCHes of own
    pages to ``touched``. One at a time; others go on without waiting (a shortfall's waits, see above).
  * Dropped at once (misses from then on; ``dropped`` counts it) and closed once no call uses it: a peer
    judged ``RETIRED``, or whose directory is gone or made anew (another inode, or a lease of a new
    incarnation whose journal generation is not past the last announced); one made anew is reopened in the
    same refresh. A shared raw region stands in for a directory (identity: host slot and offset).
  * ``bytes_leased``: the peers' last leased ``bytes_used`` (dead ones' until retired or reclaimed; on a
    shared raw pool only this host slot's writers').

``InUse``: every IO call the pool makes on a shard runs between ``enter`` and ``exit``; ``retire(shard)``
closes a shard taken out of the pool when the last call in it exits, and a later ``enter`` fails (a miss).
So no shard's descriptors or buffers are released under an IO in flight.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import KVTierError
from sgl_kvtier.io.engine import IOEngine
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.media.shared_raw.regions import in_share, region_identity
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.sharing.lease import read_lease
from sgl_kvtier.sharing.liveness import LeaseWatch
from sgl_kvtier.sharing.shortfall import SHORTFALL_WAIT_S, Shortfalls
from sgl_kvtier.sharing.writers import writer_dirs
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store.format import writer_dirname
from sgl_kvtier.store.meta import LEASE
from sgl_kvtier.store.shard import PageShard, SharedTelemetry
from sgl_kvtier.telemetry.counters import RateLimitedLog

log = logging.getLogger(__name__)
PEER_RETRY_S = 5.0  # a peer failing to open is tried again after this long
PEER_ERRORS = (OSError, KVTierError)


class InUse:
    """Calls in flight per shard, and shards closed once the last one ends (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[int, int] = {}
        self._pending: dict[int, tuple[PageShard, Callable[[], None]]] = {}  # retired, still in use
        self._retired: weakref.WeakSet[PageShard] = weakref.WeakSet()
        self._errlog = RateLimitedLog(log)

    def enter(self, shard: PageShard) -> bool:
        """Start a call on ``shard``; False (no call may be made) when it was retired."""
        with self._lock:
            if shard in self._retired:
                return False
            self._calls[id(shard)] = self._calls.get(id(shard), 0) + 1
            return True

    def exit(self, shard: PageShard) -> None:
        """End a call ``enter`` allowed; the last call on a retired shard closes it."""
        with self._lock:
            left = self._calls.pop(id(shard), 1) - 1
            if left:
                self._calls[id(shard)] = left
            close = self._pending.pop(id(shard), (shard, None))[1] if not left else None
        if close is not None:
            self._close(shard, close)

    def retire(self, shard: PageShard, close: Callable[[], None] | None = None) -> None:
        """No more calls on ``shard``: ``close`` it (default ``shard.close``) now if none is in flight,
        else when the last one exits. Never raises (a failed close is logged)."""
        close = shard.close if close is None else close
        with self._lock:
            self._retired.add(shard)
            if self._calls.get(id(shard)):
                self._pending[id(shard)] = (shard, close)
                return
        self._close(shard, close)

    def pending(self) -> list[PageShard]:
        """Retired shards a call still holds (a closing pool closes them all the same)."""
        with self._lock:
            shards = [s for s, _ in self._pending.values()]
            self._pending.clear()
            return shards

    def _close(self, shard: PageShard, close: Callable[[], None]) -> None:
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - a dropped shard's close must not fail the call that ended
            self._errlog.error("closing %s failed: %r", shard.layout.meta, exc)


class Peers:
    """The other writers of one pool (see the module docstring). The dicts are replaced, never mutated in
    place, so callers on other threads see a consistent snapshot. ``own_wid``: the pool's own writer id
    now (skipped); ``touched``: called with the keys other writers' TOUCH records name."""

    def __init__(self, config: StoreConfig, namespace: Namespace, ns_meta: Path, shared: SharedTelemetry,
                 watch: LeaseWatch, in_use: InUse, clock: Callable[[], float], own_wid: Callable[[], str | None],
                 touched: Callable[[list[PageKey]], None], engine: IOEngine | None = None):
        self.config = config
        self.clock = clock
        self.own_wid = own_wid
        self.touched = touched
        self.closed = False
        self._lock = threading.Lock()
        self._last = -float("inf")
        self.shortfalls = Shortfalls(config.follow_interval_s, clock)
        self.namespace = namespace
        self.ns_meta = ns_meta
        self.shared = shared
        self.watch = watch
        self.in_use = in_use
        self.engine = engine  # a reader pool's injected engine, for its first peer
        self.readers: dict[str, PageReader] = {}
        self.leases: dict[str, dict[str, Any]] = {}
        self.bytes_leased = 0
        self.dropped = 0
        self._ids: dict[str, tuple[int, int]] = {}  # wid -> (st_dev, st_ino) of its directory when opened
        self._gens: dict[str, tuple[Any, int]] = {}  # wid -> (incarnation, journal generation) last leased
        self._retry_at: dict[str, float] = {}
        self._errlog = RateLimitedLog(log)

    def refresh(self, force: bool = False, wait_s: float = 0.0) -> bool:
        """Open new writer directories, judge every peer (dropping the retired and the vanished), then
        replay the survivors' journals; at most every ``follow_interval_s`` unless ``force``; ``wait_s``:
        wait that long for another thread's refresh. True if any peer's pages changed. Never raises."""
        now = self.clock()
        if (not force and now - self._last < self.config.follow_interval_s) or not \
                self._lock.acquire(timeout=wait_s if wait_s > 0 else -1, blocking=wait_s > 0):
            return False  # fresh enough, or another thread is refreshing right now
        try:
            if self.closed:
                return False
            self._last = now
            changed = self._discover(self.own_wid(), now)
            if self._judge():  # some peer dropped: a directory made anew is opened again at once
                self._discover(self.own_wid(), now)
                self._judge()
                changed = True
            for wid, peer in list(self.readers.items()):
                try:
                    changed = peer.refresh() or changed
                except PEER_ERRORS as exc:
                    self._errlog.error("following writer %s of %s failed: %r", wid, self.ns_meta, exc)
            for peer in self.readers.values():
                keys = jr.drain_touched(peer.recovery)
                if keys:
                    self.touched(keys)
            return changed
        finally:
            self._lock.release()

    def shortfall(self, asked: Sequence[PageKey]) -> bool:
        """A lookup of ``asked`` fell short: refresh now where ``sharing.shortfall``'s rule says so (a retry
        always, any other at most every quarter interval); True if pages changed."""
        if not self.shortfalls.due(asked):
            return False
        # A lookup that falls short must see the peers as of now: wait for a refresh in flight elsewhere.
        return self.refresh(force=True, wait_s=SHORTFALL_WAIT_S)

    def _discover(self, own_wid: str | None, now: float) -> bool:
        found = False
        readers = dict(self.readers)
        try:
            listed = writer_dirs(self.ns_meta)
        except OSError as exc:  # the namespace directory unreachable now (its filesystem's client gone)
            log.debug("writer directories of %s not listed: %r", self.ns_meta, exc)
            return False
        for wid, path in listed:
            if wid == own_wid or wid in readers or now < self._retry_at.get(wid, -float("inf")):
                continue
            if self.watch.retired(path, read_lease(path / LEASE)) is not None:
                continue  # being deleted: never read from again
            ident = _dir_id(path)
            engine, self.engine = self.engine, None
            try:
                readers[wid] = PageReader.open(self.config, self.namespace, wid=wid, engine=engine,
                                               shared=self.shared, follows_peer=True, clock=self.clock)
            except PEER_ERRORS as exc:  # being created right now, or damaged: tried again later
                self._retry_at[wid] = now + PEER_RETRY_S
                log.debug("writer %s of %s not readable yet: %r", wid, self.ns_meta, exc)
                continue
            self._retry_at.pop(wid, None)
            if ident is not None:
                self._ids[wid] = ident
            found = True
        self.readers = readers
        return found

    def _judge(self) -> bool:
        readers, leases = dict(self.readers), {}
        dropped = False
        for wid in list(readers):
            path = self.ns_meta / writer_dirname(wid)
            ident = _dir_id(path)
            lease = read_lease(path / LEASE)
            self.watch.watch(path, lease)  # its mark's changes are timed from the first refresh on
            why = ("its directory is gone" if ident is None else
                   "its directory was made anew" if ident != self._ids.get(wid, ident) or self._anew(wid, lease)
                   else self.watch.retired(path, lease))
            if why is not None:
                self._drop(readers.pop(wid), why)
                if ident is None:
                    self.watch.forget(path)
                dropped = True
                continue
            if lease is not None:
                leases[wid] = lease
        self.readers, self.leases = readers, leases
        self.bytes_leased = sum(int(lease.get("bytes_used", 0)) for lease in leases.values()
                                if in_share(self.config, lease))
        return dropped

    def _anew(self, wid: str, lease: dict[str, Any] | None) -> bool:
        """Whether ``lease`` is of a new incarnation that did not start a newer journal generation."""
        journal = None if lease is None else lease.get("journal")
        if not isinstance(journal, list | tuple) or not journal or not isinstance(journal[0], int):
            return False
        was, self._gens[wid] = self._gens.get(wid), (lease.get("incarnation") if lease else None, journal[0])
        return was is not None and was[0] != self._gens[wid][0] and journal[0] <= was[1]

    def _drop(self, peer: PageReader, why: str) -> None:
        self.dropped += 1
        self._ids.pop(peer.wid, None)
        self._gens.pop(peer.wid, None)
        log.info("no longer reading writer %s of %s: %s", peer.wid, self.ns_meta, why)
        self.in_use.retire(peer)

    def close_all(self) -> tuple[list[PageShard], IOEngine | None] | None:
        """Stop refreshing and empty the view: every peer, retired shards still in use and the unused
        engine, for the caller to close; None when this was done already."""
        with self._lock:
            if self.closed:
                return None
            self.closed = True
            readers: list[PageShard] = list(self.readers.values())
            self.readers, engine, self.engine = {}, self.engine, None
        return readers + self.in_use.pending(), engine


def _dir_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except NotADirectoryError:
        return region_identity(path)  # a region of a shared raw pool
    except OSError:
        return None
    return st.st_dev, st.st_ino
