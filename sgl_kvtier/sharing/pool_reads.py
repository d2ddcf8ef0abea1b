"""The reads of a ``sharing.pool.SharedPool``: each key from the writer holding it (a mixin of the pool).

    get(keys, pages) -> [bool]                            as ``PageShard.get``, each page from its holder
    get_parts(keys, pages, on_part, groups=None) -> [bool] as ``PageShard.get_parts``, over every holder

Routing: a key goes to the first shard holding it (own first, then the peers), so one batch may read from
several writers' segments. ``get_parts`` opens one ``PartRead`` per holder and runs them in lock step
(``store.part_reads.drive``): ``on_part(g, ok)`` sees group ``g`` of the whole batch, whichever writer
each page came from. A peer that fails under a call (its files gone, the pool closing) serves misses,
never an error (``_call``). Hits on peers' pages are journaled as uses (``PageStore.touch_remote``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

from sgl_kvtier.io.buffers import Run
from sgl_kvtier.keys import KEY_BYTES, Namespace, PageKey
from sgl_kvtier.sharing.peers import PEER_ERRORS, InUse
from sgl_kvtier.store.page_store import PageStore
from sgl_kvtier.store.part_reads import OnPart, PartRead, drive
from sgl_kvtier.store.parts import PartMap
from sgl_kvtier.store.shard import PageShard
from sgl_kvtier.telemetry.counters import StoreCounters

log = logging.getLogger(__name__)
_T = TypeVar("_T")
Routes = list[tuple[PageShard, list[int]]]  # (holder, indices of its keys in the batch)


class PoolReads:
    """``get`` and ``get_parts`` of a pool (see the module docstring); the pool provides the rest."""

    namespace: Namespace
    counters: StoreCounters
    _in_use: InUse

    @property
    def own(self) -> PageStore | None:
        raise NotImplementedError

    def _shards(self) -> list[PageShard]:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    def refresh(self, force: bool = False, wait_s: float = 0.0) -> bool:
        raise NotImplementedError

    def _call(self, shard: PageShard, call: Callable[[], _T], fallback: _T) -> _T:
        """``call()`` on ``shard``; for a peer, ``fallback`` where its files failed under it. A call on a
        shard the pool took out since (a dropped peer, a replaced fenced own store) is ``fallback`` too."""
        if not self._in_use.enter(shard):
            return fallback
        try:
            return self._peer_call(shard, call, fallback)
        finally:
            self._in_use.exit(shard)

    def _peer_call(self, shard: PageShard, call: Callable[[], _T], fallback: _T) -> _T:
        """``call()`` on ``shard``, held in use by the caller; ``fallback`` where a peer's files failed."""
        try:
            return call()
        except PEER_ERRORS as exc:  # StoreClosedError included: the pool is closing under the call
            if shard is self.own:  # the own store's errors are the caller's (one replaced since is not own)
                raise
            log.debug("a read of %s failed: %r", shard.layout.meta, exc)
            return fallback

    def _holder(self, key: PageKey) -> PageShard | None:
        for shard in self._shards():
            if shard.contains(key):
                return shard
        return None

    def _routes(self, keys: Sequence[PageKey]) -> Routes:
        """Each key's holder (an invalid key goes to the own store, which counts the bad request); keys no
        writer holds are counted as misses here."""
        routes: dict[int, tuple[PageShard, list[int]]] = {}
        for i, key in enumerate(keys):
            valid = valid_key(key)
            holder = self._holder(key) if valid else self.own
            if holder is None:
                if valid:
                    self.counters.get_misses += 1
                else:
                    self.counters.bad_requests += 1
                continue
            routes.setdefault(id(holder), (holder, []))[1].append(i)
        return list(routes.values())

    def get(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]]) -> list[bool]:
        """Read pages into the caller's runs, each from the writer holding it; False for a miss or a page
        failing verification (never an error from a peer)."""
        self._check_open()
        self.refresh()
        results = [False] * len(keys)
        routes = self._routes(keys)
        for shard, picked in routes:
            call = partial(shard.get, [keys[i] for i in picked], [pages[i] for i in picked])
            for i, ok in zip(picked, self._call(shard, call, [False] * len(picked))):
                results[i] = ok
        self._touch_remote(keys, routes, results)
        return results

    def get_parts(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]], on_part: OnPart,
                  groups: Sequence[Sequence[int]] | None = None) -> list[bool]:
        """``PageShard.get_parts`` over the pool: group 0 of every page of the batch (from whichever writer
        holds it), verified, then ``on_part(0, ok)``, then group 1, ...; the pages read whole.

        Raises ValueError for ``groups`` not covering every part once; what ``on_part`` raises, once
        every shard's IO in flight landed and its pins and buffers are released."""
        self._check_open()
        plan = PartMap.of(self.namespace.part_sizes()).plan(groups)
        self.refresh()
        routes = self._routes(keys)
        reads: list[PartRead] = []
        held: list[PageShard] = []  # in use until the whole read ran: a peer dropped meanwhile closes after it
        try:
            try:
                for shard, picked in routes:
                    if not self._in_use.enter(shard):
                        continue  # taken out of the pool since the routes were made: its pages miss
                    held.append(shard)
                    call = partial(shard.part_read, [keys[i] for i in picked], [pages[i] for i in picked], plan,
                                   picked)
                    read = self._peer_call(shard, call, None)
                    if read is not None:
                        reads.append(read)
            except BaseException:
                for read in reads:  # the own store's pin failed (closed): let go of the peers' pins
                    read.close()
                raise
            results = drive(reads, len(keys), len(plan), on_part)
        finally:
            for shard in held:
                self._in_use.exit(shard)
        self._touch_remote(keys, routes, results)
        return results

    def _touch_remote(self, keys: Sequence[PageKey], routes: Routes, results: list[bool]) -> None:
        remote = [keys[i] for shard, picked in routes if shard is not self.own for i in picked if results[i]]
        own = self.own
        if remote and own is not None and own.fenced is None:  # a fenced store writes nothing, uses included
            own.touch_remote(remote)


def valid_key(key: object) -> bool:
    """Whether ``key`` is a page key's 32 bytes."""
    return isinstance(key, bytes) and len(key) == KEY_BYTES
