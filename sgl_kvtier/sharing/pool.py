"""SharedPool: one merged view over every writer of a namespace shard (what the SGLang adapter holds under
``sharing = "host"`` and ``"cluster"``: ``sharing.views``).

A pool opened as a writer (``open_writer``) opens its own ``PageStore`` through its site
(``sharing.sites.open_writer``); one opened as a reader (``open_reader``: MLA ranks that only read) has
none. Either way it follows every OTHER writer through a read-only ``PageReader`` (a *peer*,
``sharing.peers``), discovered lazily on refresh. All shards share one set of counters, breakers and read
rates (``store.shard.SharedTelemetry``): the devices are the same.

API (keys, pages and results as ``PageShard``'s): get / get_parts (``sharing.pool_reads``), longest_prefix
(own index, then the peers'), present (which keys some writer holds), shortfall, put (keys a peer holds are
not stored again: True, counted present), delete / evict / clear / checkpoint (own pages only), contains,
slot_of, parent_of, keys, stats, refresh, peers, leases, verdict, peer_alive, sharing_stats, close; a context
manager.

Rules:
  * Never wrong bytes: a peer's page is read through the same verified path, against its owner's journaled
    checksum; a stale mapping is a miss, counted as ``remote_reuse_races``, not as corruption.
  * Never an exception from a peer into callers: a peer whose files fail serves misses; one retired or
    vanished is dropped (closed once no call uses it); one failing to open is retried later. A killed
    writer's pages stay readable (its files are intact) until a live writer reclaims or retires it.
  * One ``liveness.LeaseWatch`` per pool judges every other writer, for peers, quota and ``verdict`` alike.
  * Refresh runs from the calls themselves (no thread), at most every ``follow_interval_s``, and again when a
    lookup falls short (``shortfall``, by ``sharing.shortfall``'s rule: a retry always, any other at most
    every quarter of that): ``longest_prefix`` short of its keys, or a caller's answer built on ``present``
    short of what it asked (the side pools of SGLang's v2 existence query).
  * Pool-wide cap: the own store is told the peers' leased ``bytes_used`` (``PageStore.peer_bytes``); the
    quota (``sharing.quota_loop``) runs after each beat; a fenced own store is replaced by
    ``sharing.fencing``. Hits on peers' pages are journaled as TOUCHes; peers' TOUCHes warm own pages.
  * Never an OSError from the own store's writes either (put, delete, evict, clear, checkpoint): the write is
    refused (not stored, 0, nothing done), counted and logged (``RejoiningWriter.write_failed``); a store
    whose descriptors are lost is replaced by a fresh writer at a later write (``sharing.fencing``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import DeviceError, KVTierError, StoreClosedError
from sgl_kvtier.io.buffers import Run
from sgl_kvtier.io.engine import IOEngine
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.sharing.fencing import RejoiningWriter
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.sharing.liveness import Judged, LeaseWatch, Verdict
from sgl_kvtier.sharing.peers import InUse, Peers
from sgl_kvtier.sharing.pool_reads import PoolReads, valid_key
from sgl_kvtier.sharing.quota_loop import QuotaLoop
from sgl_kvtier.sharing.sites import open_writer, site_for
from sgl_kvtier.sharing.writers import writer_dirs
from sgl_kvtier.store.format import writer_dirname
from sgl_kvtier.store.health import DeviceHealth
from sgl_kvtier.store.layout import Layout
from sgl_kvtier.store.lifecycle import ClosedOnExit, Failure, Step, StoreCloseError, handed_on, run_steps, weak_method
from sgl_kvtier.store.page_store import PageStore
from sgl_kvtier.store.read_rates import ReadRates
from sgl_kvtier.store.shard import PageShard, SharedTelemetry
from sgl_kvtier.telemetry.counters import StoreCounters, StoreStats

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class SharedPool(PoolReads, ClosedOnExit):
    """The merged view over every writer of one namespace shard (see the module docstring)."""

    CLOSING = "the pool"

    def __init__(self, config: StoreConfig, namespace: Namespace, ns_meta: Path, own: PageStore | None,
                 shared: SharedTelemetry, *, engine: IOEngine | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.namespace = namespace
        self.ns_meta = ns_meta
        self.page_bytes = namespace.page_bytes
        self.counters: StoreCounters = shared.counters
        self.health: DeviceHealth = shared.health
        self._read_rates = shared.read_rates
        self.clock = clock
        self._shared = shared
        self._watch = LeaseWatch(config, clock if own is None else own.clock)
        self._in_use = InUse()
        # The parts call back into the pool weakly (``store.lifecycle.weak_method``): no reference cycles.
        self._followed = Peers(config, namespace, ns_meta, shared, self._watch, self._in_use, clock,
                               weak_method(self._own_wid, None), weak_method(self._touched, None), engine)
        self._closed = False
        self._writer = None if own is None else RejoiningWriter(own, ns_meta, self._watch, self._in_use,
                                                           weak_method(self._leased_peer_bytes, 0), shared, clock)

    @property
    def own(self) -> PageStore | None:
        """The own writer's store now (None: a reader pool); replaced when fenced (``sharing.fencing``)."""
        return None if self._writer is None else self._writer.store

    @property
    def quota(self) -> QuotaLoop | None:
        """The quota loop on the own store (None: a reader pool)."""
        return None if self._writer is None else self._writer.quota

    # ------------------------------------------------------------------ open / close
    @classmethod
    def open_writer(cls, config: StoreConfig, namespace: Namespace, *, engine: IOEngine | None = None,
                    clock: Callable[[], float] | None = None) -> SharedPool:
        """Open a writer of ``namespace`` on its site (``sharing.sites.open_writer``; ``clock``: its page-age
        clock) and follow the other writers; the quota runs after each lease beat from here on.
        Raises what ``PageStore.open`` raises; peers that fail to open are retried later."""
        shared = _telemetry(config)
        own = open_writer(config, namespace, engine=engine, shared=shared, clock=clock)
        pool = cls(config, namespace, own.layout.ns_meta, own, shared)
        if pool._writer is not None:
            pool._writer.writable()  # a directory found fenced at open is replaced now (``sharing.fencing``)
        pool.refresh(force=True)
        return pool

    @classmethod
    def open_reader(cls, config: StoreConfig, namespace: Namespace, *, engine: IOEngine | None = None) -> SharedPool:
        """Follow every writer of ``namespace`` read-only. Raises DeviceError while no writer has made its
        directory (or none can be opened yet): retry later."""
        ns_meta = site_for(config).meta_dir(namespace)
        if not writer_dirs(ns_meta):
            if engine is not None:
                engine.close()
            raise DeviceError(f"{ns_meta}: no store here (no writer has made it yet)")
        pool = cls(config, namespace, ns_meta, None, _telemetry(config), engine=engine)
        pool.refresh(force=True)
        if not pool._followed.readers:
            pool.close()
            raise DeviceError(f"{ns_meta}: no writer directory can be opened yet")
        return pool

    def close(self) -> None:
        """Close every peer, then the own store (its checkpoint first), each whatever the others raise.
        The own store's ``StoreCloseError`` is raised as it is when it is the only failure; otherwise one
        ``StoreCloseError`` names every failed step. Idempotent."""
        taken = self._followed.close_all()
        if taken is None:
            return
        self._closed = True
        peers, engine = taken
        own_steps = [] if self._writer is None else self._writer.close_steps()  # no quota step from here on
        steps: list[Step] = [(f"peer {p.layout.wid}", p.close) for p in peers]
        if engine is not None:
            steps.append(("unused io engine", engine.close))
        steps += own_steps
        failures = run_steps(steps)
        if failures:  # raised from a helper: this frame is in their tracebacks and keeps none (lifecycle.handed_on)
            raise _close_error(f"the pool of {self.namespace.dirname()}", handed_on(failures))

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("page store is closed")

    @property
    def read_rates(self) -> ReadRates:
        """The measured read rates of every shard of the pool (one set: the devices are the same)."""
        return self._read_rates

    @read_rates.setter
    def read_rates(self, rates: ReadRates) -> None:
        """Measure from here on into ``rates`` (every shard, peers opened later too)."""
        self._read_rates = rates
        self._shared = dataclasses.replace(self._shared, read_rates=rates)
        for shard in self._shards():
            shard.read_rates = rates

    # ------------------------------------------------------------------ who is in the pool
    @property
    def writer(self) -> bool:
        """Whether this pool has a writer of its own (``put`` stores pages)."""
        return self.own is not None

    @property
    def wid(self) -> str | None:
        """The own writer's id, or None for a reader pool."""
        return None if self.own is None else self.own.wid

    @property
    def layout(self) -> Layout:
        """The own writer's layout (a reader pool: its first peer's)."""
        return self._first().layout

    @property
    def slot_bytes(self) -> int:
        return self._first().slot_bytes

    def _first(self) -> PageShard:
        if self.own is not None:
            return self.own
        peers = list(self._followed.readers.values())
        if not peers:
            raise StoreClosedError("page store is closed")
        return peers[0]

    def peers(self) -> dict[str, PageReader]:
        """The other writers followed now, by wid."""
        return dict(self._followed.readers)

    def leases(self) -> dict[str, dict[str, Any]]:
        """The peers' last leases read, by wid (refreshed with the journals)."""
        return dict(self._followed.leases)

    def verdict(self, wid: str) -> Judged:
        """The pool's lease watch's verdict on writer ``wid`` now, from its last lease read."""
        return self._watch.judge(self.ns_meta / writer_dirname(wid), self._followed.leases.get(wid))

    def peer_alive(self, wid: str) -> bool | None:
        """Whether peer ``wid``'s writer is alive (``verdict``: live True; dead or retired False; None: unknown)."""
        verdict = self.verdict(wid).verdict
        return None if verdict is Verdict.UNKNOWN else verdict is Verdict.LIVE

    def sharing_stats(self) -> dict[str, int]:
        """Peers dropped (retired or vanished), writers of other hosts retired by this one, pages refused
        while fenced, re-registrations after a fence."""
        w = self._writer
        mine = {"writers_retired": 0, "fenced_pages": 0, "reregistrations": 0} if w is None else w.stats()
        return {"peers_dropped": self._followed.dropped, **mine}

    def _shards(self) -> list[PageShard]:
        own: list[PageShard] = [] if self.own is None else [self.own]
        return own + list(self._followed.readers.values())

    def _own_wid(self) -> str | None:
        return self.wid

    def _leased_peer_bytes(self) -> int:
        return self._followed.bytes_leased

    # ------------------------------------------------------------------ refresh
    def refresh(self, force: bool = False, wait_s: float = 0.0) -> bool:
        """Follow every peer's journal, open new writer directories, read and judge the leases
        (``Peers.refresh``); True if any peer's pages changed. Never raises."""
        return self._followed.refresh(force, wait_s)

    def _touched(self, keys: list[PageKey]) -> None:
        own = self.own
        if own is not None and own.fenced is None:
            own.touch_own([k for k in keys if own.contains(k)])

    # ------------------------------------------------------------------ queries
    def longest_prefix(self, keys: Sequence[PageKey]) -> int:
        """How many leading ``keys`` some writer of the pool holds readable now (re-reading the peers'
        journals first when the answer falls short: ``shortfall``)."""
        self._check_open()
        self.refresh()
        n = self._prefix(keys)
        if n < len(keys) and self.shortfall(keys):
            n = self._prefix(keys)
        return n

    def present(self, keys: Sequence[PageKey]) -> list[bool]:
        """Whether some writer of the pool holds each of ``keys`` (the view refreshed first, at most every
        ``follow_interval_s``). A caller whose answer falls short of what it asked for calls ``shortfall``
        and asks again."""
        self._check_open()
        self.refresh()
        return [self.contains(k) for k in keys]

    def shortfall(self, asked: Sequence[PageKey]) -> bool:
        """A lookup of ``asked`` fell short: re-read the peers first where ``sharing.shortfall``'s rule says so
        (a retry always, any other at most every quarter of ``follow_interval_s``); True if their pages
        changed (ask again)."""
        return self._followed.shortfall(asked)

    def _prefix(self, keys: Sequence[PageKey]) -> int:
        keys = list(keys)
        pos = 0
        while pos < len(keys):
            step = 0
            for shard in self._shards():
                step = self._call(shard, partial(shard.longest_prefix, keys[pos:]), 0)
                if step:
                    break
            if not step:
                break
            pos += step
        return pos

    def contains(self, key: PageKey) -> bool:
        """Whether some writer of the pool has ``key`` in its index."""
        return valid_key(key) and self._holder(key) is not None

    def slot_of(self, key: PageKey) -> int | None:
        """The global slot holding ``key`` in ``layout`` (the own writer's; a reader pool's first peer's)."""
        return self._first().slot_of(key)

    def parent_of(self, key: PageKey) -> PageKey | None:
        """The page ``key`` chains on, as its holder recorded it, or None."""
        holder = self._holder(key) if valid_key(key) else None
        return None if holder is None else holder.parent_of(key)

    def keys(self) -> list[PageKey]:
        """Every stored key, own first (a key two writers hold is listed once)."""
        seen: dict[PageKey, None] = {}
        for shard in self._shards():
            seen.update(dict.fromkeys(shard.keys()))
        return list(seen)

    def __len__(self) -> int:
        """Pages over all writers (a page two writers both hold counts twice)."""
        return sum(len(shard) for shard in self._shards())

    def stats(self) -> StoreStats:
        """The own store's stats (a reader pool: its first peer's) with the pool's pages and bytes."""
        base = self._first().stats()
        pages = len(self)
        base.pages, base.bytes_used = pages, pages * base.slot_bytes
        base.counters = self.counters.snapshot()
        return base

    # ------------------------------------------------------------------ writes (own pages only)
    def put(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]], parent: PageKey | None = None) -> list[bool]:
        """Store pages as ``PageStore.put`` does, except those some peer holds already (True, counted as
        ``put_present``): the pool keeps one copy of a page. Raises KVTierError on a reader pool."""
        self._check_open()
        if self._writer is None:
            raise KVTierError(f"shard {self.namespace.dirname()} is open read-only here")
        own = self._writer.writable()
        if own.fenced is not None:  # fenced, and no fresh directory yet: refused without IO
            self._writer.fenced_pages += len(keys)
            return [False] * len(keys)
        self.refresh()
        peers = list(self._followed.readers.values())
        held = [valid_key(k) and any(p.contains(k) for p in peers) for k in keys]
        results = [True] * len(keys)
        start = 0
        while start < len(keys):
            if held[start]:
                self.counters.put_present += 1
                start += 1
                continue
            end = start
            while end < len(keys) and not held[end]:
                end += 1
            # The run chains on the key before it, whoever holds that one.
            chain = keys[start - 1] if start > 0 else parent
            refused = [False] * (end - start)
            results[start:end] = self._own_write(own, partial(own.put, keys[start:end], pages[start:end], chain),
                                                 refused)
            start = end
        return results

    def delete(self, keys: Sequence[PageKey]) -> int:
        """Drop own pages among ``keys`` (others' are theirs); how many."""
        return self._own_call(lambda own: own.delete(keys), 0)

    def evict(self, keys: Sequence[PageKey]) -> int:
        """Evict own pages among ``keys`` (the pool quota's choice); how many."""
        return self._own_call(lambda own: own.evict(keys), 0)

    def clear(self) -> int:
        """Drop every own page; how many."""
        return self._own_call(lambda own: own.clear(), 0)

    def checkpoint(self) -> None:
        """Checkpoint the own store (a reader pool has nothing to checkpoint)."""
        self._own_call(lambda own: own.checkpoint(), None)

    def _own_call(self, call: Callable[[PageStore], _T], fallback: _T) -> _T:
        """``call(own store)``, a fenced one replaced first; ``fallback`` for a reader pool or while fenced."""
        if self._writer is None:
            return fallback
        own = self._writer.writable()
        return fallback if own.fenced is not None else self._own_write(own, partial(call, own), fallback)

    def _own_write(self, own: PageStore, call: Callable[[], _T], fallback: _T) -> _T:
        """``call()``, a write on the own store; ``fallback`` where it raised OSError (refused, never an error
        for the caller: ``RejoiningWriter.write_failed`` counts it and gives up a store whose descriptors are
        lost)."""
        assert self._writer is not None
        try:
            return self._call(own, call, fallback)
        except OSError as exc:
            self.counters.io_errors += 1
            self._writer.write_failed(own, exc)
            return fallback


def _telemetry(config: StoreConfig) -> SharedTelemetry:
    health = DeviceHealth(list(config.devices), config.breaker_failures, config.breaker_cooldown_s, config.slow_io_s)
    return SharedTelemetry(StoreCounters(), health, ReadRates(len(config.devices)))


def _close_error(what: str, failures: list[Failure]) -> BaseException:
    """``SharedPool.close``'s error: the first interrupt, else a lone failure as it is (the own store's
    ``StoreCloseError``), else one ``StoreCloseError`` from the first naming every failed step."""
    interrupt = next((e for _, e in failures if not isinstance(e, Exception)), None)
    if interrupt is not None:
        return interrupt
    if len(failures) == 1:
        return failures[0][1]
    error = StoreCloseError(what, failures)
    error.__cause__ = failures[0][1]  # as ``raise ... from`` sets it
    return error
