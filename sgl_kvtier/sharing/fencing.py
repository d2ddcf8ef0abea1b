"""A pool's own writer (``sharing.pool``): its store, its quota loop, its fence, and its re-registration
(the protocol argument is in docs/design/sharing.md).

``RejoiningWriter`` holds the pool's current own ``PageStore`` and the ``QuotaLoop`` on it. Under
``sharing = "cluster"`` it arms each own store's fence:
  * Every lease beat first reads the own FENCE (``liveness.OwnFence`` through ``Lease.fence_check``). Once a
    live writer of another host has retired this one (``sharing.retire``), the lease stops and the store is
    ``fenced``: it writes nothing more there (puts refused without IO, counted as ``fenced_pages``).
  * The next write call (``writable``) re-registers under a lock: a fresh writer directory through the site
    (the fenced one's LOCK is still held, so the claim skips it) and a new store with its quota loop. The
    fenced store is closed without a checkpoint once no call uses it (``peers.InUse``). Gets go on; a failed
    open is retried after PEER_RETRY_S, puts refused meanwhile. Nothing raises into callers.
  * A directory found fenced at open is never written: it is fenced anew under this incarnation (so every
    observer judges it ``RETIRED`` and finishes the deletion) and another is claimed at once, up to
    REREGISTER_TRIES in a row.
On a shared raw pool (``host_index``) the lease checks instead that the host slot was not taken over
(``PageStore.host_check``, ``sharing.shared_raw_claim``); re-registering is refused while that machine
beats. Closing reads the fence once more (a store retired since its last beat writes no checkpoint). Under
``sharing = "host"`` no fence is armed.

Lost descriptors, under ``"host"`` and ``"cluster"`` alike: a write on the own store that raises OSError is
refused (``write_failed``; the pool answers it as not stored, never an error); one whose error says the
store's descriptors are lost for good (``store.lost_handles``: its filesystem's client died and the mount
was made again, a file removed under it) gives the store up as a fence does: ``fenced`` with that reason, its
lease stopped, and the next write re-registers, retried every PEER_RETRY_S until the filesystem answers
again. The lease stops by itself on such an error too (``sharing.lease``). The directory given up keeps its
pages: the new writer follows it as a peer (fresh descriptors) until it is reclaimed or retired.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

from sgl_kvtier.config import Sharing
from sgl_kvtier.errors import KVTierError
from sgl_kvtier.sharing.liveness import LeaseWatch, OwnFence
from sgl_kvtier.sharing.peers import PEER_RETRY_S, InUse
from sgl_kvtier.sharing.quota_loop import QuotaLoop
from sgl_kvtier.sharing.retire import write_fence
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.sharing.writers import WriterClaim, host_id
from sgl_kvtier.store.lifecycle import Step
from sgl_kvtier.store.lost_handles import handle_lost, lost_reason
from sgl_kvtier.store.page_store import PageStore
from sgl_kvtier.store.shard import SharedTelemetry
from sgl_kvtier.telemetry.counters import RateLimitedLog

log = logging.getLogger(__name__)
REREGISTER_TRIES = 8  # fresh directories claimed in a row that turn out fenced too (then: tried later)


class RejoiningWriter:
    """The pool's own writer (see the module docstring). ``store`` and ``quota`` are replaced, never
    mutated: a caller reading them once works on one consistent store."""

    def __init__(self, store: PageStore, ns_meta: Path, watch: LeaseWatch, in_use: InUse,
                 peer_bytes: Callable[[], int], shared: SharedTelemetry, clock: Callable[[], float]):
        self.ns_meta = ns_meta
        self.watch = watch
        self.in_use = in_use
        self.peer_bytes = peer_bytes
        self.shared = shared
        self.clock = clock  # when a failed re-registration is tried again
        self.fenced_pages = 0  # pages refused because the own store was fenced
        self.reregistrations = 0
        self._retired_before = 0  # writers retired by the quota loops of own stores replaced since
        self._fences: dict[int, OwnFence] = {}  # id(store) -> its FENCE, closed with it
        self._swap = threading.Lock()  # one re-registration at a time
        self._retry_at = -float("inf")
        self._closed = False
        self._errlog = RateLimitedLog(log)
        self.store = store
        self.quota = QuotaLoop(store, ns_meta, peer_bytes, watch=watch)
        self._arm(store)

    @property
    def retired(self) -> int:
        """Writers of other hosts retired by this pool's quota loops."""
        return self._retired_before + self.quota.retired

    def stats(self) -> dict[str, int]:
        """``writers_retired``, ``fenced_pages``, ``reregistrations`` (``SharedPool.sharing_stats``)."""
        return {"writers_retired": self.retired, "fenced_pages": self.fenced_pages,
                "reregistrations": self.reregistrations}

    def writable(self) -> PageStore:
        """The own store to write to: a fenced one is replaced first (see the module docstring). The
        store returned may still be fenced (no fresh directory could be opened yet)."""
        store = self.store
        if store.fenced is not None and not self._closed:
            with self._swap:
                if self.store is store and not self._closed:
                    self._reregister(store)
            store = self.store
        return store

    def close_steps(self) -> list[Step]:
        """What closing the pool runs for its own writer: no more quota steps, the store, its fences."""
        with self._swap:  # no re-registration from here on
            self._closed = True
        self.quota.stop()
        fence = self._fences.get(id(self.store))
        if self.store.fenced is None and fence is not None:  # retired since the last beat: no checkpoint there
            self.store.fenced = fence.check()
        elif self.store.fenced is None and self.store.host_check is not None:  # its host slot taken over
            self.store.fenced = self.store.host_check()
        fences = list(self._fences.values())
        self._fences.clear()
        return [("writer", self.store.close), *[("fence", f.close) for f in fences]]

    def write_failed(self, store: PageStore, exc: OSError) -> None:
        """A write on ``store`` raised ``exc``; the caller answers it as refused. Lost descriptors give the
        store up (module docstring); any other error leaves it as it is (the next write tries again)."""
        if handle_lost(exc) and store.fenced is None:
            reason = lost_reason(exc)
            store.fenced = reason
            if store.lease is not None and store.lease.fenced is None:
                store.lease.fenced = reason  # no more beats through the lost descriptors
            log.warning("writer %s of %s gave up its directory: %s; the next write re-registers", store.wid,
                        self.ns_meta, reason)
            return
        self._errlog.error("a write of writer %s of %s failed (refused): %r", store.wid, self.ns_meta, exc)

    # ------------------------------------------------------------------ fence
    def _arm(self, store: PageStore) -> None:
        if store.lease is None:
            return
        # Fenced or its descriptors lost (``sharing.lease``), under any sharing mode: the next write re-registers.
        store.lease.on_fenced = partial(self._on_fenced, store)
        if store.config.sharing is not Sharing.CLUSTER:
            return
        if store.host_check is not None:  # a shared raw pool: its host slot, not a FENCE (module docstring)
            store.lease.fence_check = store.host_check
            return
        try:
            lock_fd = store.claim.lock_fd if isinstance(store.claim, WriterClaim) else None
            fence = OwnFence(store.claim.path, store.incarnation, lock_fd)  # made empty here where absent
        except OSError as exc:
            self._errlog.error("%s: cannot open its FENCE (fencing off for it): %r", store.claim.path, exc)
            return
        self._fences[id(store)] = fence
        store.lease.fence_check = fence.check
        found = fence.check(any_incarnation=True)
        if found is None:
            return
        store.lease.fenced = store.fenced = f"claimed a directory being retired ({found})"
        log.warning("%s: %s; claiming another", store.claim.path, store.fenced)
        try:  # its lease names this incarnation now: with the fence naming it too, everyone sees RETIRED
            write_fence(store.claim.path, store.incarnation, store.wid, host_id(store.config))
        except OSError as exc:
            self._errlog.error("%s: fencing it anew failed: %r", store.claim.path, exc)

    def _on_fenced(self, store: PageStore, reason: str) -> None:
        store.fenced = reason  # on the lease thread: puts refused from now on; the next write re-registers

    # ------------------------------------------------------------------ re-register
    def _reregister(self, old: PageStore) -> None:
        now = self.clock()
        if now < self._retry_at:
            return
        held: list[PageStore] = []  # fenced directories claimed on the way: their LOCKs make the claim move on
        new: tuple[PageStore, QuotaLoop] | None = None
        try:
            for _ in range(REREGISTER_TRIES):
                store = open_writer(old.config, old.namespace, shared=self.shared, clock=old.clock)
                quota = QuotaLoop(store, self.ns_meta, self.peer_bytes, watch=self.watch)
                self._arm(store)
                if store.fenced is None:
                    new = store, quota
                    break
                quota.stop()
                held.append(store)
        except (OSError, KVTierError) as exc:
            self._errlog.error("re-registering fenced writer %s of %s failed (tried again later): %r",
                               old.wid, self.ns_meta, exc)
        for store in held:
            self.in_use.retire(store, partial(self._close_fenced, store))
        if new is None:
            self._retry_at = now + PEER_RETRY_S
            return
        old_quota = self.quota
        self.store, self.quota = new
        old_quota.stop()
        self._retired_before += old_quota.retired
        self.reregistrations += 1
        log.warning("fenced writer %s of %s re-registered as %s (%s)", old.wid, self.ns_meta, new[0].wid, old.fenced)
        self.in_use.retire(old, partial(self._close_fenced, old))

    def _close_fenced(self, store: PageStore) -> None:
        fence = self._fences.pop(id(store), None)
        try:
            store.close()  # fenced: no checkpoint; its lease thread ends, its LOCK goes last
        finally:
            if fence is not None:
                fence.close()
