"""The pool quota, kept by every writer of a namespace shard with no coordinator (``policy.quota``).

Each writer of a ``SharedPool`` (``pool.quota``) runs ``QuotaLoop.step`` right after each of its lease
beats (the ``kvtier-lease`` thread, through ``Lease.after_beat``, installed by the constructor; tests call
``step`` or ``Lease.beat`` directly with injected clocks). One step:
  1. Usages: its own is exactly what the beat just published (``PageStore.published``: ``bytes_used`` and
     ``age_hist`` at the clock's ``now``); every other ``w-<wid>`` directory of the namespace is read from
     its LEASE. A peer's ``seen_age_s`` is how long its lease (counter, incarnation) has not changed on
     THIS writer's clock. ``live`` is ``writers.writer_alive`` (same host: a free LOCK is dead at once); for
     a writer of another host, unknown there, a lease unchanged for ``DEAD_AFTER_BEATS`` of its heartbeats
     counts as dead in the plan (nobody here can reclaim it: its bytes just stop being asked of the live).
     A directory with no readable lease has published nothing and counts nothing.
  2. ``quota.plan`` over them with ``capacity_bytes`` (None: the layout's capacity) and the config's
     ``quota_high`` / ``quota_low`` / ``min_share_bytes``. A cutoff evicts the writer's own pages at least
     that old (``PageStore.evict_older_than``: chain-aware policy order, journaled DELs, then holes punched
     over the freed slots no reader pins). ``may_grow`` sets the store's growth limit (False: a new page
     replaces an own one; the hard cap against the peers' leases stays in the reserve path either way).
  3. Dead writers of this host whose share ``quota.dead_writer_plan`` asks for (so: whenever the pool is
     over ``quota_high``; dead bytes go before any live writer's): ``reclaim`` opens that directory as a
     ``PageStore`` by wid (a non-blocking LOCK claim: held means it restarted or another writer is
     reclaiming it, so skip; warm recovery as any open), evicts its coldest ``evict_bytes`` with holes,
     beats its lease once (the pool sees its smaller ``bytes_used``), and closes it, releasing the lock
     last. Its remaining pages stay readable to everyone. A restarted instance claiming the lowest free
     ``k`` gets its directory back warm; if its claim races a reclaim, it takes the next ``k`` (a cold
     start: fine, the reclaim is brief and the old directory is reclaimed later like any dead one).

Invariants: a writer only ever evicts its own pages (or, holding its LOCK, a dead writer's); one step at a
time per writer (a step finding one in progress returns at once); a step never raises past the lease
thread (``Lease`` counts a failed beat); every writer computes from the same leases the same cutoff.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sgl_kvtier.errors import KVTierError, StoreLockedError
from sgl_kvtier.policy import quota
from sgl_kvtier.store.lease import LEASE, read_lease
from sgl_kvtier.store.page_store import PageStore
from sgl_kvtier.store.writers import host_id, writer_alive, writer_dirs

log = logging.getLogger(__name__)
DEAD_AFTER_BEATS = 5.0  # another host's lease unchanged this many of its heartbeats: dead for the plan


@dataclass
class QuotaStep:
    """What one step did: the plan (None: skipped, a step was in progress or nothing was published yet),
    own pages evicted and bytes punched, and pages evicted per reclaimed dead writer."""

    plan: quota.QuotaPlan | None
    evicted_pages: int = 0
    punched_bytes: int = 0
    reclaimed: dict[str, int] = field(default_factory=dict)
    usages: list[quota.WriterUsage] = field(default_factory=list)


class QuotaLoop:
    """One writer's side of the pool quota (see the module docstring)."""

    def __init__(self, own: PageStore, ns_meta: Path, peer_bytes: Callable[[], int] | None = None,
                 clock: Callable[[], float] | None = None):
        """``peer_bytes``: what the own store's hard cap counts of the other writers (the pool's number)."""
        self.own = own
        if peer_bytes is not None:
            own.peer_bytes = peer_bytes
        self.ns_meta = ns_meta
        self.clock = own.clock if clock is None else clock
        self.last: QuotaStep | None = None
        self._seen: dict[str, tuple[Any, float]] = {}  # wid -> ((counter, incarnation), when it last changed)
        self._busy = threading.Lock()
        self._stopped = False
        if own.lease is not None:
            own.lease.after_beat = self.on_beat  # from now on, a step after each beat

    def stop(self) -> None:
        """No more steps (the pool is closing); one in progress finishes."""
        self._stopped = True
        if self.own.lease is not None:
            self.own.lease.after_beat = None

    def on_beat(self) -> None:
        """``Lease.after_beat``: run one step."""
        self.step()

    def step(self) -> QuotaStep:
        """Plan from the leases and act on it: evict own old pages, reclaim dead writers of this host."""
        if self._stopped or not self._busy.acquire(blocking=False):
            return QuotaStep(None)
        try:
            result = self._step()
            self.last = result
            return result
        finally:
            self._busy.release()

    def _step(self) -> QuotaStep:
        own, config = self.own, self.own.config
        published = own.published
        if published is None:
            return QuotaStep(None)
        at, mine = published
        usages, dead_here = self._usages(self.clock())
        usages.append(quota.WriterUsage(own.wid, True, int(mine["bytes_used"]), tuple(mine["age_hist"])))
        cap = own.pool_capacity_bytes()
        knobs = (config.quota_high, config.quota_low, config.min_share_bytes)
        plan = quota.plan(usages, own.wid, cap, *knobs, grow_bytes=own.slot_bytes)
        result = QuotaStep(plan, usages=usages)
        if plan.cutoff_age_s is not None and plan.evict_bytes > 0:
            result.evicted_pages, result.punched_bytes = own.evict_older_than(plan.cutoff_age_s, at, plan.evict_bytes)
        own.grow_limit_bytes = None if plan.may_grow else len(own) * own.slot_bytes
        for wid in dead_here:
            share = quota.dead_writer_plan(usages, wid, cap, *knobs).evict_bytes
            if share > 0:
                result.reclaimed[wid] = self.reclaim(wid, share)
        if result.evicted_pages or result.reclaimed:
            log.debug("quota of %s: %s", own.wid, result)
        return result

    def _usages(self, now: float) -> tuple[list[quota.WriterUsage], list[str]]:
        """Every other writer's usage from its lease, and the wids of this host's dead writers."""
        here = host_id(self.own.config)
        usages: list[quota.WriterUsage] = []
        dead_here: list[str] = []
        for wid, path in writer_dirs(self.ns_meta):
            if wid == self.own.wid:
                continue
            lease = read_lease(path / LEASE)
            if lease is None:
                continue
            seen_age = self._seen_age(wid, lease, now)
            alive = writer_alive(path, lease, here)
            live = alive if alive is not None else seen_age <= DEAD_AFTER_BEATS * float(lease.get("heartbeat_s", 2.0))
            hist = tuple(int(b) for b in lease.get("age_hist") or ())
            usages.append(quota.WriterUsage(wid, live, int(lease.get("bytes_used", 0)), hist, seen_age))
            if alive is False:
                dead_here.append(wid)
        return usages, dead_here

    def _seen_age(self, wid: str, lease: dict[str, Any], now: float) -> float:
        mark = (lease.get("counter"), lease.get("incarnation"))
        seen = self._seen.get(wid)
        if seen is None or seen[0] != mark:
            self._seen[wid] = (mark, now)
            return 0.0
        return max(0.0, now - seen[1])

    def reclaim(self, wid: str, evict_bytes: int) -> int:
        """Evict the coldest ``evict_bytes`` of dead writer ``wid`` of this host (see the module docstring);
        pages evicted (0: its lock is held, or it could not be opened: logged, tried on a later step)."""
        try:
            store = PageStore.open(self.own.config, self.own.namespace, wid=wid, clock=self.clock)
        except StoreLockedError:
            return 0  # it restarted, or another live writer is reclaiming it
        except (OSError, KVTierError) as exc:
            log.warning("reclaiming dead writer %s of %s failed: %r", wid, self.ns_meta, exc)
            return 0
        try:
            # Its ages are all "now" in a fresh index: cutoff 0.0 takes the policy's coldest first.
            evicted, _ = store.evict_older_than(0.0, store.clock(), evict_bytes)
            if store.lease is not None:
                store.lease.beat()  # publish what is left before the lock goes (close releases it last)
        finally:
            store.close()
        log.info("reclaimed %d pages of dead writer %s of %s", evicted, wid, self.ns_meta)
        return evicted
