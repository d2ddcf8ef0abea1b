"""HostShard: one SGLang host pool bound to its page-store shard; SGLang's call shapes in, store calls out.

A host shard is bound to its pool first (``bind``: geometry and namespace, nothing opened) and opened once the
backend knows all its pools and so each one's share of the capacity (``open``; ``reopen`` when a pool
registered later changes the shares). It holds a ``sharing.views.PoolView`` chosen from the config at open
(``open_view``): the merged view over every writer process of its namespace (``SharedPool``), or under
``sharing = "off"`` the shard's one writer alone (``SoleShard``). Writer ranks open it with a writer directory
of their own; ranks that only read a replicated (MLA) shard open it read-only and lazily, retrying while no
writer has created it. An open store gets a read-ahead stage (``config.readahead_bytes``; 0: none): ``stage``
starts the reads of an exists query's hit, and every read goes through it.

``snapshot`` refreshes the pool's view first (``PoolView.refresh``, rate-limited as lookups are), so an idle
server's figures follow the pool and the verdicts judge current leases. It lists the own writer (``retired``
while fenced; no lease age where it beats none), every other writer from its last lease with the pool's
verdict (``PoolView.verdict``) and lease age (one stat and one probe per writer), and for ``RETIRED_SHOWN_S``
each writer that left the pool or is judged ``RETIRED``, as ``retired`` with no pages; then the pool's
sharing counters.

``close`` stops the read-ahead and closes the store, both whatever the other raises, each detached before it
is released; the first failure is raised, the other as its note (``store.lifecycle.release_all``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import DeviceError, KVTierError
from sgl_kvtier.estimation import TransferEstimator
from sgl_kvtier.io.buffers import Run
from sgl_kvtier.keys import Namespace, PageKey, valid_runs
from sgl_kvtier.prefetch import ReadAhead, ReadAheadCounters
from sgl_kvtier.sglang.host_pages import Access, HostPages, check_indices, tensor_run
from sgl_kvtier.sglang.settings import namespace_for
from sgl_kvtier.sharing.liveness import Verdict
from sgl_kvtier.sharing.pool_status import lease_age
from sgl_kvtier.sharing.views import PoolView, open_view
from sgl_kvtier.store.lifecycle import release_all
from sgl_kvtier.telemetry.snapshot import (
    SHARING_COUNTERS,
    Breaker,
    DeviceSnapshot,
    PoolSnapshot,
    RateSnapshot,
    ReadAheadSnapshot,
    StoreSnapshot,
    WriterSnapshot,
    WriterState,
    frozen_counts,
)

log = logging.getLogger(__name__)
READER_RETRY_S = 5.0
RETIRED_SHOWN_S = 60.0  # a writer that left the pool is listed ``retired`` this long (see the module docstring)
_READAHEAD_FIELDS = tuple(f.name for f in dataclasses.fields(ReadAheadCounters))


@dataclass
class HostShard:
    """One registered host pool, its shard's store (None while a reader's shard is not open) and read-ahead."""

    name: str
    pages: HostPages
    namespace: Namespace
    config: StoreConfig
    writer: bool
    store: PoolView | None = None  # the pool: with a writer of its own, or (a reader rank) without
    readahead: ReadAhead | None = None
    opened: bool = False  # ``open`` ran (a reader's store may still be None: its shard is not there yet)
    _next_open: float = field(default=0.0, repr=False)
    _gone: WritersGone = field(default_factory=lambda: WritersGone(), repr=False)

    @classmethod
    def bind(cls, name: str, pages: HostPages, storage_config: Any, config: StoreConfig, writer: bool) -> HostShard:
        """``pages`` bound to its shard's namespace; nothing is opened yet (``open``)."""
        return cls(name, pages, namespace_for(storage_config, pages, name), config, writer)

    def open(self, config: StoreConfig) -> None:
        """Open the shard under ``config`` (this host shard's share of the capacity): a writer now (its errors
        propagate), a reader as soon as the writer rank has made it."""
        self.config = config
        self.opened = True
        if self.writer:
            self._attach(open_view(config, self.namespace, writer=True))
        else:
            self._next_open = 0.0
            self._reader()

    def reopen(self, config: StoreConfig) -> None:
        """Close the shard and open it again under ``config`` (a new capacity share); the store drops the
        pages past a smaller share at open."""
        self.close()
        self.open(config)

    def _reader(self) -> PoolView | None:
        """A reader's store, opened on first need (retried every ``READER_RETRY_S`` while not created)."""
        if self.opened and self.store is None and time.monotonic() >= self._next_open:
            try:
                self._attach(open_view(self.config, self.namespace, writer=False))
            except DeviceError:  # not created by any writer yet
                self._next_open = time.monotonic() + READER_RETRY_S
        return self.store

    def _attach(self, store: PoolView) -> None:
        self.store = store
        if self.config.readahead_bytes >= self.pages.page_bytes:
            # Chunks of io_depth pages: each staging job keeps the device queue full, and a span's first
            # pages are ready before its last ones are read.
            self.readahead = ReadAhead(store.get, self.pages.page_bytes, self.config.readahead_bytes,
                                       chunk_pages=self.config.io_depth)

    def _store(self) -> PoolView:
        """The open store, or ``KVTierError`` when the shard does not exist yet."""
        store = self.store if self.writer else self._reader()
        if store is None:
            raise KVTierError(f"shard {self.namespace.dirname()} does not exist yet")
        return store

    # ------------------------------------------------------------------ queries
    def longest_prefix(self, keys: Sequence[PageKey]) -> int:
        """Leading keys stored by any writer of the pool (the pool re-reads the other writers' journals before
        answering short, by the shortfall rule: ``sharing.shortfall``)."""
        store = self.store if self.writer else self._reader()
        if store is None:
            return 0
        return store.longest_prefix(keys)

    def stage(self, keys: Sequence[PageKey]) -> int:
        """Start reading ``keys`` (an exists query's hit) into staging; how many reads started."""
        return 0 if self.readahead is None else self.readahead.stage(keys)

    def _get(self, store: PoolView, keys: Sequence[PageKey], runs: Sequence[Sequence[Run]]) -> list[bool]:
        return store.get(keys, runs) if self.readahead is None else self.readahead.read(keys, runs)

    def contains(self, key: PageKey) -> bool:
        """Whether ``key`` is stored in this pool's open shard (by any of its writers)."""
        return self.store is not None and self.store.contains(key)

    def present(self, keys: Sequence[PageKey]) -> list[bool]:
        """Whether each of ``keys`` is stored by any writer of the pool (its view refreshed first, rate-limited,
        as every lookup does); all False while a reader's shard is not open."""
        store = self.store if self.writer else self._reader()
        return [False] * len(keys) if store is None else store.present(keys)

    def shortfall(self, asked: Sequence[PageKey]) -> bool:
        """A lookup of ``asked`` (``present``) fell short of it: the pool re-reads the other writers first where
        the shortfall rule says so (``sharing.shortfall``: a retry always); True if their pages changed."""
        store = self.store if self.writer else self._reader()
        return store is not None and store.shortfall(asked)

    # ------------------------------------------------------------------ host-index transfers
    def read(self, keys: Sequence[PageKey | None], host_indices: torch.Tensor) -> list[bool]:
        """Read the leading readable run of ``keys`` into the pool; SGLang only uses that run."""
        _check(host_indices, len(keys), self.pages.page_tokens)
        store = self._store()
        valid: list[PageKey] = []
        for k in keys:
            if k is None:
                break
            valid.append(k)
        n = store.longest_prefix(valid)
        if n == 0:
            return [False] * len(keys)
        span = host_indices[:n * self.pages.page_tokens]
        if self.pages.access is Access.ZERO_COPY:
            oks = self._get(store, valid[:n], self.pages.page_runs(span))
        else:
            flats = [self.pages.pool.get_dummy_flat_data_page() for _ in range(n)]
            oks = self._get(store, valid[:n], [[tensor_run(f)] for f in flats])
            for start, flat, ok in zip(self.pages.page_starts(span), flats, oks):
                if ok:
                    self.pages.pool.set_from_flat_data_page(start, flat)
        return oks + [False] * (len(keys) - n)

    def write(self, keys: Sequence[PageKey | None], host_indices: torch.Tensor, parent: PageKey | None) -> list[bool]:
        """Store the pages at ``host_indices`` under ``keys`` (``None`` keys are skipped, reported False)."""
        _check(host_indices, len(keys), self.pages.page_tokens)
        if self.pages.access is Access.ZERO_COPY:
            runs = self.pages.page_runs(host_indices)
            keepalive: list[torch.Tensor] = []
        else:
            keepalive = [self.pages.pool.get_data_page(s, flat=True).contiguous()
                         for s in self.pages.page_starts(host_indices)]
            runs = [[tensor_run(t)] for t in keepalive]
        return self._put(keys, runs, parent)

    # ------------------------------------------------------------------ flat tensors (legacy API)
    def read_flat(self, keys: Sequence[PageKey | None], tensors: list[torch.Tensor]) -> list[bool]:
        """Read pages into flat page tensors (legacy API); False where a key or tensor does not fit."""
        store = self._store()
        picked = [(i, k) for i, (k, t) in enumerate(zip(keys, tensors)) if k is not None and self._fits(t)]
        oks = self._get(store, [k for _, k in picked], [[tensor_run(tensors[i])] for i, _ in picked])
        out = [False] * len(keys)
        for (i, _), ok in zip(picked, oks):
            out[i] = ok
        return out

    def write_flat(self, keys: Sequence[PageKey | None], tensors: list[torch.Tensor]) -> list[bool]:
        """Store flat page tensors (legacy API); False where a key or tensor does not fit."""
        ok_shape = [t is not None and self._fits(t) for t in tensors]
        runs = [[tensor_run(t.contiguous())] if fits else [] for t, fits in zip(tensors, ok_shape)]
        return [ok and fits for ok, fits in zip(self._put(keys, runs, None), ok_shape)]

    def _fits(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and t.numel() * t.element_size() == self.pages.page_bytes

    def _put(self, keys: Sequence[PageKey | None], runs: list[list[Run]], parent: PageKey | None) -> list[bool]:
        """Store each valid run of ``keys`` from ``runs`` (writer only); False for each page not stored."""
        store = self._store()
        if not store.writer:
            raise KVTierError(f"shard {self.namespace.dirname()} is open read-only here")
        out = [False] * len(keys)
        # An invalid key (None) is a page not stored. It splits the batch: the page after it chains on
        # nothing (its real predecessor has no key), never on the page before the gap.
        for start, run in valid_runs(keys):
            out[start:start + len(run)] = store.put(run, runs[start:start + len(run)], parent if start == 0 else None)
        return out

    def clear(self) -> None:
        """Drop every page of the shard (writer only)."""
        if self.store is not None and self.store.writer:
            self.store.clear()

    def snapshot(self) -> PoolSnapshot:
        """This pool's telemetry: the store's occupancy, counters, read rates and breakers, and read-ahead."""
        store, readahead = self.store, self.readahead
        staged = None
        if readahead is not None:
            snap = readahead.snapshot()  # one consistent copy, under the stage's lock
            staged = ReadAheadSnapshot(int(snap["buffers_in_use"]),
                                       frozen_counts({f: int(snap[f]) for f in _READAHEAD_FIELDS}))
        return PoolSnapshot(self.name, self.pages.page_bytes,
                            None if store is None else _store_snapshot(store, self._gone), staged)

    def close(self) -> None:
        """Stop read-ahead, then close the store: both attempted, whatever the other raises; then the first
        failure is raised (``StoreCloseError`` from the store, typically), the other as its note."""
        readahead, store, self.readahead, self.store = self.readahead, self.store, None, None  # detached first
        self.opened = False
        steps = [] if readahead is None else [(f"pool {self.name} read-ahead", readahead.close)]  # reads the store
        if store is not None:
            steps.append((f"pool {self.name} store", store.close))
        release_all(steps)


def _rate(estimator: TransferEstimator) -> RateSnapshot:
    """An estimator's fitted read rate (None fields: no model yet) and sample count."""
    model = estimator.model()
    return RateSnapshot(None if model is None else model.bandwidth_Bps,
                        None if model is None else model.batch_latency_s, estimator.samples)


def _store_snapshot(store: PoolView, gone: WritersGone | None = None) -> StoreSnapshot:
    """The pool's occupancy, rates, devices, writers (``gone``: with those that left) and sharing counters."""
    # The pool's view first (rate-limited as lookups do it; never raises): an idle server's snapshot follows
    # the other writers too, and the verdicts below judge the leases as read now, not as of the last lookup.
    store.refresh()
    stats, rates = store.stats(), store.read_rates
    devices = tuple(DeviceSnapshot(h["device"], _rate(est), Breaker(h["state"]), int(h["trips"]))
                    for h, est in zip(store.health.summary(), rates.devices))
    writers = _writers(store)
    if gone is not None:
        writers = gone.update(writers, time.monotonic(), set(store.peers()))
    own = sum(w.bytes_used for w in writers if w.own)
    cap = store.config.capacity_bytes
    sharing = store.sharing_stats()
    return StoreSnapshot(stats.pages, stats.bytes_used, stats.capacity_bytes, _rate(rates.total), devices,
                         frozen_counts(stats.counters), store.namespace.digest().hex(), writers,
                         own + sum(int(lease.get("bytes_used", 0)) for lease in store.leases().values()),
                         stats.capacity_bytes if cap is None else cap,
                         frozen_counts({k: int(sharing.get(k, 0)) for k in SHARING_COUNTERS}))


_STATE = {Verdict.LIVE: WriterState.LIVE, Verdict.DEAD: WriterState.DEAD, Verdict.RETIRED: WriterState.RETIRED,
          Verdict.UNKNOWN: WriterState.UNKNOWN}


def _writers(store: PoolView) -> tuple[WriterSnapshot, ...]:
    """The own writer (its usage now, its last beat's age) and every other one from its last lease, judged
    by the pool's lease watch."""
    rows = []
    own = store.own
    if own is not None:
        usage = own.usage()
        beat = None if own.lease is None else own.lease.last_beat
        age = None if own.lease is None or beat is None else max(0.0, own.lease.clock() - beat)
        state = WriterState.LIVE if own.fenced is None else WriterState.RETIRED
        rows.append(WriterSnapshot(own.wid, own.claim.host_id, state, int(usage["pages"]), int(usage["bytes_used"]),
                                   age, own=True))
    now = time.time()
    for wid, lease in sorted(store.leases().items()):
        judged = store.verdict(wid)
        # A fenced writer's lease outlives its fence for a moment (the retirer deletes it after): its pages are
        # no longer read from the fence on, so it is listed with none.
        held = judged.verdict is not Verdict.RETIRED
        rows.append(WriterSnapshot(wid, str(lease.get("host_id", "")), _STATE[judged.verdict],
                                   int(lease.get("pages", 0)) if held else 0,
                                   int(lease.get("bytes_used", 0)) if held else 0,
                                   lease_age(store.ns_meta / f"w-{wid}", now),
                                   lease_unchanged_s=None if judged.same_host else judged.unchanged_s))
    return tuple(rows)


@dataclass
class WritersGone:
    """The writers one host shard listed, to list those that left the pool as ``retired`` for a while
    (``RETIRED_SHOWN_S``; see the module docstring)."""

    shown_s: float = RETIRED_SHOWN_S
    _last: dict[str, tuple[WriterSnapshot, float]] = field(default_factory=dict)  # wid -> (row, last seen)

    def update(self, rows: tuple[WriterSnapshot, ...], now: float, followed: set[str]) -> tuple[WriterSnapshot, ...]:
        """``rows`` plus a ``retired`` row (no pages, no lease figures) for each writer listed within
        ``shown_s`` that is in neither ``rows`` nor ``followed`` (the peers followed now: a peer whose lease
        was unreadable this once is still in the pool)."""
        listed = {w.wid for w in rows}
        for w in rows:
            self._last[w.wid] = (w, now)
        extra = []
        for wid, (row, seen) in list(self._last.items()):
            if wid in listed:
                continue
            if wid in followed:
                continue  # still followed: not gone, just no lease this time (its last row is not repeated)
            if now - seen > self.shown_s:
                del self._last[wid]
                continue
            extra.append(WriterSnapshot(wid, row.host, WriterState.RETIRED, 0, 0, own=row.own))
        return rows + tuple(extra)


def _check(host_indices: Any, n_keys: int, page_tokens: int) -> None:
    """``ValueError`` when ``host_indices`` cannot carry ``n_keys`` pages (``check_indices``)."""
    problem = check_indices(host_indices, n_keys, page_tokens)
    if problem is not None:
        raise ValueError(problem)
