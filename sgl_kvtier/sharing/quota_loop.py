"""The pool quota, kept by every writer of a namespace shard with no coordinator (``policy.quota``).

Each writer of a ``SharedPool`` runs ``QuotaLoop.step`` after each of its lease beats (``Lease.after_beat``,
on the ``kvtier-lease`` thread). One step:
  1. Usages: its own is what the beat just published (``PageStore.published``); every other writer's comes
     from its LEASE, judged by the pool's ``liveness.LeaseWatch``. A ``RETIRED`` writer, or one with no
     readable lease, counts nothing.
  2. ``quota.plan`` over them: a cutoff evicts own pages at least that old (``PageStore.evict_older_than``:
     journaled DELs, then holes punched); ``may_grow`` sets the store's ``grow_limit_bytes`` (the hard cap
     against the peers' leases stays in the reserve path either way).
  3. A dead writer of this host whose share ``quota.dead_writer_plan`` asks for is reclaimed (``reclaim``):
     opened by wid (a held LOCK means it restarted or is being reclaimed: skipped), its coldest bytes
     evicted, its lease beaten once, closed (lock last). Its other pages stay readable to everyone.
  4. ``sharing = "cluster"`` only: a dead writer of another host is retired (``sharing.retire``) when the
     plan asks for its bytes or once ``LeaseWatch.reclaim_due``, its lease read once more just before (one
     that moved is live again); every directory judged ``RETIRED`` has its deletion continued.
On a shared raw pool (``host_index``) the quota is this host's share: other host slots' writers count
nothing and are never retired. Invariants: a writer evicts only its own pages (or, holding its LOCK, a dead
one's of this host; or deletes a fenced writer's files); one step at a time per writer; a step never raises
past the lease thread; every writer computes the same cutoff from the same leases.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sgl_kvtier.config import Sharing
from sgl_kvtier.errors import KVTierError, StoreLockedError
from sgl_kvtier.media.shared_raw.regions import in_share
from sgl_kvtier.policy import quota
from sgl_kvtier.sharing import retire as rt
from sgl_kvtier.sharing.lease import read_lease
from sgl_kvtier.sharing.liveness import Judged, LeaseWatch, Verdict
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.sharing.writers import host_id, writer_dirs
from sgl_kvtier.store.format import writer_dirname
from sgl_kvtier.store.meta import LEASE
from sgl_kvtier.store.page_store import PageStore

log = logging.getLogger(__name__)
_Dead = tuple[str, dict[str, Any], Judged]  # a dead writer of another host: wid, its last lease, the verdict


@dataclass
class QuotaStep:
    """What one step did: the plan (None: skipped, a step was in progress or nothing was published yet),
    own pages evicted and bytes punched, pages evicted per reclaimed dead writer (this host's), the leased
    bytes of each writer of another host retired, and the retired directories whose deletion it continued."""

    plan: quota.QuotaPlan | None
    evicted_pages: int = 0
    punched_bytes: int = 0
    reclaimed: dict[str, int] = field(default_factory=dict)
    retired: dict[str, int] = field(default_factory=dict)
    continued: list[str] = field(default_factory=list)
    usages: list[quota.WriterUsage] = field(default_factory=list)


class QuotaLoop:
    """One writer's side of the pool quota (see the module docstring)."""

    def __init__(self, own: PageStore, ns_meta: Path, peer_bytes: Callable[[], int] | None = None,
                 clock: Callable[[], float] | None = None, watch: LeaseWatch | None = None):
        """``peer_bytes``: what the own store's hard cap counts of the other writers (the pool's number);
        ``watch``: the pool's lease watch (default: one of its own on ``clock``)."""
        self.own = own
        if peer_bytes is not None:
            own.peer_bytes = peer_bytes
        self.ns_meta = ns_meta
        self.clock = own.clock if clock is None else clock
        self.last: QuotaStep | None = None
        self.watch = LeaseWatch(own.config, self.clock) if watch is None else watch
        self.retired = 0  # writers of other hosts this loop retired
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
        usages, dead_here, dead_there, going = self._usages()
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
        for wid, lease, judged in dead_there:  # cluster mode only (``_usages``)
            if quota.dead_writer_plan(usages, wid, cap, *knobs).evict_bytes > 0 or self.watch.reclaim_due(judged):
                if self.retire(wid, lease):
                    result.retired[wid] = int(lease.get("bytes_used", 0))
        for wid in going:
            if self.continue_retirement(wid):
                result.continued.append(wid)
        if result.evicted_pages or result.reclaimed or result.retired:
            log.debug("quota of %s: %s", own.wid, result)
        return result

    def _usages(self) -> tuple[list[quota.WriterUsage], list[str], list[_Dead], list[str]]:
        """Every other writer's usage from its lease and verdict; the wids of this host's dead writers; the
        dead writers of other hosts and the retired directories (both only under ``sharing = "cluster"``)."""
        cluster = self.own.config.sharing is Sharing.CLUSTER
        usages: list[quota.WriterUsage] = []
        dead_here: list[str] = []
        dead_there: list[_Dead] = []
        going: list[str] = []
        for wid, path in writer_dirs(self.ns_meta):
            if wid == self.own.wid:
                continue
            lease = read_lease(path / LEASE)
            if lease is None and not cluster:
                continue  # nothing published (and, outside cluster mode, no fence to look for)
            if lease is not None and not in_share(self.own.config, lease):
                continue  # another host slot of a shared raw pool: not in this host's quota
            judged = self.watch.judge(path, lease)
            if judged.verdict is Verdict.RETIRED:
                going.append(wid)
                continue
            if lease is None:
                continue
            dead = judged.verdict is Verdict.DEAD
            hist = tuple(int(b) for b in lease.get("age_hist") or ())
            usages.append(quota.WriterUsage(wid, not dead, int(lease.get("bytes_used", 0)), hist, judged.unchanged_s))
            if dead and judged.same_host:
                dead_here.append(wid)
            elif dead and cluster and self.own.config.host_index is None:  # never retired on a raw pool
                dead_there.append((wid, lease, judged))
        return usages, dead_here, dead_there, going

    def retire(self, wid: str, lease: dict[str, Any]) -> bool:
        """Retire dead writer ``wid`` of another host whose last lease is ``lease`` (``sharing.retire``); True
        once it is fenced. False: its lease moved meanwhile (alive after all), or the fence failed (logged,
        tried again on a later step). A deletion failing after the fence is continued later."""
        path = self.ns_meta / writer_dirname(wid)
        now = read_lease(path / LEASE)
        incarnation = lease.get("incarnation")
        if now is None or _mark(now) != _mark(lease) or not isinstance(incarnation, bytes):
            return False  # it beat again (or its lease went): judged afresh on the next step
        config = self.own.config
        try:
            fenced = rt.write_fence(path, incarnation, self.own.wid, host_id(config))
        except OSError as exc:
            log.warning("fencing dead writer %s of %s failed: %r", wid, self.ns_meta, exc)
            return False
        if not fenced:  # another writer is retiring it and is past its lease: only directories may be left
            self.continue_retirement(wid)
            return False
        self.retired += 1
        log.info("fenced dead writer %s of %s; deleting its files", wid, self.ns_meta)
        self.continue_retirement(wid)
        return True

    def continue_retirement(self, wid: str) -> bool:
        """Delete what is left of retired writer ``wid`` (``retire.delete_writer``); True once its directory
        is gone. Never raises (a failure is logged; the next step continues)."""
        try:
            done = rt.delete_writer(self.own.config, self.ns_meta, wid)
        except OSError as exc:
            log.warning("deleting retired writer %s of %s failed (continued later): %r", wid, self.ns_meta, exc)
            return False
        if done.finished:
            self.watch.forget(self.ns_meta / writer_dirname(wid))
        return done.finished

    def reclaim(self, wid: str, evict_bytes: int) -> int:
        """Evict the coldest ``evict_bytes`` of dead writer ``wid`` of this host (see the module docstring);
        pages evicted (0: its lock is held, or it could not be opened: logged, tried on a later step)."""
        try:
            store = open_writer(self.own.config, self.own.namespace, wid=wid, clock=self.clock)
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


def _mark(lease: dict[str, Any]) -> tuple[Any, Any]:
    return lease.get("counter"), lease.get("incarnation")
