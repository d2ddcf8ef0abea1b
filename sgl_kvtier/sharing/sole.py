"""SoleShard: a namespace shard with one writer (``sharing = "off"``), served as it is, with no pool around it.

A writer process holds the shard's one ``PageStore`` (``open_writer``: ``sharing.sites.SoleSite``, so
``w-<host_id>-0`` and no lease). A rank that only reads it (``open_reader``: MLA ranks) follows that writer
through one ``PageReader``. Nothing else: no peers, no lease thread, no quota loop, no fencing; the store
keeps its own ``capacity_bytes`` alone. Other writer directories an earlier shared run left in the
namespace are neither read nor counted (a live one refuses the open: ``sharing.writers.refuse_mixed_modes``).

It answers the calls of a ``sharing.views.PoolView`` as a pool of one writer: ``peers`` and ``leases`` are
empty, the sharing counters stay 0, ``verdict`` knows only its own writer. A reader re-reads its writer's
journal at most every ``follow_interval_s`` (again on a lookup that falls short, by ``sharing.shortfall``'s
rule, as a pool re-reads its peers); errors of the one shard are the caller's, as a ``PageStore``'s are.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import DeviceError, KVTierError
from sgl_kvtier.io.buffers import Run
from sgl_kvtier.io.engine import IOEngine
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.sharing.liveness import Judged, Verdict
from sgl_kvtier.sharing.peers import PEER_ERRORS
from sgl_kvtier.sharing.shortfall import SHORTFALL_WAIT_S, Shortfalls
from sgl_kvtier.sharing.sites import open_writer, site_for
from sgl_kvtier.sharing.writers import host_id, writer_dirs
from sgl_kvtier.store.layout import Layout
from sgl_kvtier.store.lifecycle import ClosedOnExit
from sgl_kvtier.store.page_store import PageStore
from sgl_kvtier.store.part_reads import OnPart
from sgl_kvtier.store.read_rates import ReadRates
from sgl_kvtier.store.shard import PageShard
from sgl_kvtier.telemetry.counters import RateLimitedLog, StoreStats
from sgl_kvtier.telemetry.snapshot import SHARING_COUNTERS

log = logging.getLogger(__name__)


class SoleShard(ClosedOnExit):
    """One writer's shard as the whole pool (see the module docstring): its ``PageStore``, or a reader's
    ``PageReader`` following it."""

    CLOSING = "the shard"

    def __init__(self, shard: PageStore | PageReader, clock: Callable[[], float] = time.monotonic):
        self.own: PageStore | None = shard if isinstance(shard, PageStore) else None
        self._shard: PageShard = shard
        self._reader = None if isinstance(shard, PageStore) else shard
        self.config: StoreConfig = shard.config
        self.namespace: Namespace = shard.namespace
        self.ns_meta: Path = shard.layout.ns_meta
        self.page_bytes = shard.page_bytes
        self.counters = shard.counters
        self.health = shard.health
        self.clock = clock
        self._last = -float("inf")
        self.shortfalls = Shortfalls(self.config.follow_interval_s, clock)
        self._closed = False
        self._errlog = RateLimitedLog(log)
        self._refreshing = threading.Lock()

    # ------------------------------------------------------------------ open / close
    @classmethod
    def open_writer(cls, config: StoreConfig, namespace: Namespace, *, engine: IOEngine | None = None,
                    clock: Callable[[], float] | None = None) -> SoleShard:
        """Open the shard's one writer (``sharing.sites.open_writer``; ``clock``: its page-age clock). Raises
        what ``PageStore.open`` raises: StoreLockedError naming the holder where another process writes it."""
        return cls(open_writer(config, namespace, engine=engine, clock=clock))

    @classmethod
    def open_reader(cls, config: StoreConfig, namespace: Namespace, *, engine: IOEngine | None = None) -> SoleShard:
        """Follow the shard's writer read-only: ``w-<host_id>-0``, else the lowest writer directory there
        (the writer's host is another). Raises DeviceError while it is not there or not readable yet: retry."""
        ns_meta = site_for(config).meta_dir(namespace)
        present = [wid for wid, _ in writer_dirs(ns_meta)]
        mine = f"{host_id(config)}-0"
        if not present:
            if engine is not None:
                engine.close()
            raise DeviceError(f"{ns_meta}: no store here (no writer has made it yet)")
        try:
            reader = PageReader.open(config, namespace, wid=mine if mine in present else present[0], engine=engine,
                                     follows_peer=True)
        except PEER_ERRORS as exc:  # being made right now (the engine was closed with the failed open)
            raise DeviceError(f"{ns_meta}: its writer is not readable yet ({exc})") from exc
        return cls(reader)

    def close(self) -> None:
        """Close the shard (a writer checkpoints first: ``PageStore.close``). Idempotent."""
        self._closed = True
        self._shard.close()

    # ------------------------------------------------------------------ who is in the pool
    @property
    def writer(self) -> bool:
        """Whether this process writes the shard (``put`` stores pages)."""
        return self.own is not None

    @property
    def wid(self) -> str | None:
        """The writer's id, or None for a reader."""
        return None if self.own is None else self.own.wid

    @property
    def layout(self) -> Layout:
        return self._shard.layout

    @property
    def slot_bytes(self) -> int:
        return self._shard.slot_bytes

    @property
    def read_rates(self) -> ReadRates:
        """The shard's measured read rates."""
        return self._shard.read_rates

    @read_rates.setter
    def read_rates(self, rates: ReadRates) -> None:
        self._shard.read_rates = rates

    def peers(self) -> dict[str, PageReader]:
        """No other writer is followed: {}."""
        return {}

    def leases(self) -> dict[str, dict[str, Any]]:
        """No other writer's lease is read: {}."""
        return {}

    def verdict(self, wid: str) -> Judged:
        """This process's writer is live; any other is not judged here (``UNKNOWN``)."""
        if wid == self.wid:
            return Judged(Verdict.LIVE, True, 0.0, "this process's writer")
        return Judged(Verdict.UNKNOWN, False, 0.0, 'sharing = "off": no other writer is followed')

    def sharing_stats(self) -> dict[str, int]:
        """The pool's sharing counters, all 0: no peer, fence or retirement here."""
        return dict.fromkeys(SHARING_COUNTERS, 0)

    # ------------------------------------------------------------------ refresh (a reader's)
    def refresh(self, force: bool = False, wait_s: float = 0.0) -> bool:
        """A reader: replay what its writer appended since, at most every ``follow_interval_s`` unless
        ``force``; True if its pages changed. A writer's view is always current (False). Never raises.
        One refresh at a time: ``wait_s``, how long to wait for one another thread is running (then this one
        runs); 0: go on at once."""
        now = self.clock()
        if self._reader is None or self._closed or (not force and now - self._last < self.config.follow_interval_s):
            return False
        if not self._refreshing.acquire(blocking=wait_s > 0, timeout=wait_s if wait_s > 0 else -1):
            return False
        try:
            self._last = now
            return self._reader.refresh()
        except PEER_ERRORS as exc:
            self._errlog.error("following writer %s of %s failed: %r", self._reader.wid, self.ns_meta, exc)
            return False
        finally:
            self._refreshing.release()

    # ------------------------------------------------------------------ queries and reads
    def longest_prefix(self, keys: Sequence[PageKey]) -> int:
        """How many leading ``keys`` the shard holds readable now (a reader re-reads its writer's journal
        first when the answer falls short: ``shortfall``)."""
        self.refresh()
        n = self._shard.longest_prefix(keys)
        if n < len(keys) and self.shortfall(keys):
            n = self._shard.longest_prefix(keys)
        return n

    def present(self, keys: Sequence[PageKey]) -> list[bool]:
        """Whether the shard holds each of ``keys`` (a reader's view refreshed first, rate-limited); a caller
        whose answer falls short calls ``shortfall`` and asks again."""
        self.refresh()
        return [self._shard.contains(k) for k in keys]

    def shortfall(self, asked: Sequence[PageKey]) -> bool:
        """A lookup of ``asked`` fell short: a reader re-reads its writer's journal first where
        ``sharing.shortfall``'s rule says so; True if its pages changed (ask again). A writer: False."""
        if self._reader is None or not self.shortfalls.due(asked):
            return False
        return self.refresh(force=True, wait_s=SHORTFALL_WAIT_S)

    def contains(self, key: PageKey) -> bool:
        return self._shard.contains(key)

    def slot_of(self, key: PageKey) -> int | None:
        return self._shard.slot_of(key)

    def parent_of(self, key: PageKey) -> PageKey | None:
        return self._shard.parent_of(key)

    def keys(self) -> list[PageKey]:
        return self._shard.keys()

    def __len__(self) -> int:
        return len(self._shard)

    def stats(self) -> StoreStats:
        return self._shard.stats()

    def get(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]]) -> list[bool]:
        """``PageShard.get`` on the shard (a reader's view refreshed first, rate-limited)."""
        self.refresh()
        return self._shard.get(keys, pages)

    def get_parts(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]], on_part: OnPart,
                  groups: Sequence[Sequence[int]] | None = None) -> list[bool]:
        """``PageShard.get_parts`` on the shard (a reader's view refreshed first, rate-limited)."""
        self.refresh()
        return self._shard.get_parts(keys, pages, on_part, groups)

    # ------------------------------------------------------------------ writes (the writer's)
    def put(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]], parent: PageKey | None = None) -> list[bool]:
        """``PageStore.put``; KVTierError for a reader."""
        return self._writer_store().put(keys, pages, parent)

    def delete(self, keys: Sequence[PageKey]) -> int:
        return 0 if self.own is None else self.own.delete(keys)

    def evict(self, keys: Sequence[PageKey]) -> int:
        return 0 if self.own is None else self.own.evict(keys)

    def clear(self) -> int:
        return 0 if self.own is None else self.own.clear()

    def checkpoint(self) -> None:
        if self.own is not None:
            self.own.checkpoint()

    def _writer_store(self) -> PageStore:
        if self.own is None:
            raise KVTierError(f"shard {self.namespace.dirname()} is open read-only here")
        return self.own
