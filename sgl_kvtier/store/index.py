"""The in-memory index of one shard: key <-> slot, page checksums (``store.parts.Checksum``, each with the
shard's number of parts, ``Recovered.parts``), last-use times and the eviction policy, kept in step.
Built from ``store.journal.Recovered``, whose dicts it takes over (not copied). Not thread-safe: the
store's lock guards every call.

Last-use times (for the pool quota, ``policy.quota``) are a float64 array by slot on the injected clock
(``time.monotonic``: one clock for every process of a host), NaN where no page is stored. Invariants:
  * ``add`` and ``touch`` stamp their pages with the clock's time; ``remove`` clears the slot.
  * Ages are not persisted: ``load`` stamps every recovered page with the load time, so a reopened store's
    pages start young (never evicted for an age they may not have).
  * Chain policy: a page's time is at least its youngest stored descendant's, less ``_LINK_SLACK_S``
    (stamping a page lends its recency up its chain, stopping at the first ancestor already that fresh),
    so a page the policy cannot drop before its descendants never looks older than they do. Removing a
    descendant leaves the recency it lent (an ancestor may look warmer than it is, never colder).
  * ``age_histogram`` and ``victims_older_than`` read ages as ``now - time`` the same way, so a page counted
    in a bucket at or past the cutoff is a page ``victims_older_than`` may take.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np

from sgl_kvtier.config import EvictionPolicyName
from sgl_kvtier.keys import PageKey
from sgl_kvtier.policy import quota
from sgl_kvtier.policy.eviction import make_policy
from sgl_kvtier.store.journal import Recovered
from sgl_kvtier.store.parts import Checksum

_LINK_SLACK_S = 0.5  # under half the youngest age bucket: lending recency up a chain stops this early


class PageIndex:
    """key <-> slot, each slot's checksum, and the eviction policy over the slots (see the module docstring)."""

    def __init__(self, recovered: Recovered, eviction: EvictionPolicyName, capacity: int,
                 clock: Callable[[], float] = time.monotonic):
        self._eviction = eviction
        self._chain = eviction is EvictionPolicyName.CHAIN
        self._capacity = capacity
        self._clock = clock
        self.load(recovered)

    def load(self, recovered: Recovered) -> None:
        """Take over ``recovered``'s state, dropping pages in slots at or past the capacity."""
        over = [k for k, s in recovered.slot_of.items() if s >= self._capacity] \
            if any(s >= self._capacity for s in recovered.key_of) else []
        for key in over:
            slot = recovered.slot_of.pop(key)
            del recovered.key_of[slot]
            recovered.checksum.pop(slot, None)
            recovered.parent.pop(slot, None)
        self.slot_of = recovered.slot_of
        self.key_of = recovered.key_of
        self.checksum = recovered.checksum
        self.parts = recovered.parts
        slots = np.fromiter(self.slot_of.values(), dtype=np.int64, count=len(self.slot_of))
        by_slot = np.full(int(slots.max(initial=-1)) + 1, -1, dtype=np.int64)
        if recovered.parent:
            by_slot[np.fromiter(recovered.parent.keys(), np.int64)] = np.fromiter(recovered.parent.values(), np.int64)
        parents = by_slot[slots]
        size = max(self._capacity, int(slots.max(initial=-1)) + 1)
        self.policy = make_policy(self._eviction, size)
        self.policy.bulk_load(slots, parents)
        self._used_at = np.full(max(size, 16), np.nan, dtype=np.float64)
        self._used_at[slots] = self._clock()

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Read last-use times from ``clock`` from now on (a store opened with an injected clock; tests);
        every stored page is stamped with its now, as ``load`` does."""
        self._clock = clock
        self._used_at[~np.isnan(self._used_at)] = clock()

    def __contains__(self, key: PageKey) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def slots(self) -> list[int]:
        """Every slot in use."""
        return list(self.slot_of.values())

    def lookup(self, key: PageKey) -> tuple[int, Checksum] | None:
        """``(slot, checksum)`` of a stored page, or None."""
        slot = self.slot_of.get(key)
        return None if slot is None else (slot, self.checksum[slot])

    def add(self, key: PageKey, slot: int, checksum: Checksum, parent: PageKey | None) -> None:
        """Index a page written to ``slot``; ``parent`` (if stored) is the page it chains on."""
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.checksum[slot] = checksum
        parent_slot = self.slot_of.get(parent) if parent is not None else None
        self.policy.insert(slot, parent_slot)
        if slot >= len(self._used_at):
            grown = np.full(max(slot + 1, 2 * len(self._used_at)), np.nan, dtype=np.float64)
            grown[:len(self._used_at)] = self._used_at
            self._used_at = grown
        now = self._clock()
        self._used_at[slot] = now
        if self._chain and parent_slot is not None:
            self._lend(parent_slot, now)

    def remove(self, key: PageKey) -> int:
        """Unindex a stored page; its slot (the caller frees it)."""
        slot = self.slot_of.pop(key)
        del self.key_of[slot]
        del self.checksum[slot]
        self.policy.remove(slot)
        self._used_at[slot] = np.nan
        return slot

    def touch(self, keys: Iterable[PageKey]) -> None:
        """Mark pages used now (a chain's keys in order, or pages another instance read); unknown keys are
        ignored."""
        slots = [self.slot_of[k] for k in keys if k in self.slot_of]
        self.policy.touch(slots)
        if not slots:
            return
        now = self._clock()
        where = np.asarray(slots, dtype=np.int64)
        self._used_at[where] = now
        if self._chain:
            parents = self.policy.parent_slots(where)
            stale = parents[parents >= 0]
            stale = stale[~(self._used_at[stale] >= now - _LINK_SLACK_S)]
            for parent in stale.tolist():
                self._lend(parent, now)

    def _lend(self, slot: int | None, now: float) -> None:
        """Stamp ``slot`` and its ancestors with ``now`` up to the first one already within the slack."""
        floor = now - _LINK_SLACK_S
        while slot is not None and not self._used_at[slot] >= floor:
            self._used_at[slot] = now
            slot = self.policy.parent_of(slot)

    def age_histogram(self, now: float, slot_bytes: int) -> tuple[int, ...]:
        """Bytes of stored pages per age bucket (``policy.quota``'s buckets) at time ``now`` of the clock:
        a lease's ``age_hist``."""
        used = self._used_at[~np.isnan(self._used_at)]
        return quota.histogram(now - used, slot_bytes)

    def victims_older_than(self, age_s: float, now: float, limit_bytes: int, slot_bytes: int) -> list[PageKey]:
        """Own pages to evict for the quota: those at least ``age_s`` old at ``now``, in the eviction
        policy's drop order (chain: deepest first, never a page before its stored descendants), until their
        bytes reach ``limit_bytes`` (the last page may pass it). Changes nothing: the caller removes them."""
        if limit_bytes <= 0 or slot_bytes <= 0:
            return []
        with np.errstate(invalid="ignore"):
            eligible = (now - self._used_at) >= age_s  # NaN (no page) compares False
        slots = self.policy.victims(-(-limit_bytes // slot_bytes), eligible)
        return [self.key_of[s] for s in slots]

    def last_used(self, key: PageKey) -> float | None:
        """When ``key`` was last used on the clock (None: not stored)."""
        slot = self.slot_of.get(key)
        return None if slot is None else float(self._used_at[slot])

    def victim(self) -> PageKey | None:
        """The page the policy would evict next, or None when empty."""
        slot = self.policy.victim()
        return None if slot is None else self.key_of[slot]

    def parent_of(self, key: PageKey) -> PageKey | None:
        """The stored page ``key`` chains on, or None."""
        parent = self.policy.parent_of(self.slot_of[key])
        return None if parent is None else self.key_of[parent]

    def snapshot(self) -> tuple[list[PageKey], np.ndarray, np.ndarray, np.ndarray]:
        """(keys, slots, checksums (``n * parts``), parent positions) coldest first, for a checkpoint."""
        order = np.asarray(self.policy.coldest_first(), dtype=np.int64)
        keys = [self.key_of[s] for s in order.tolist()]
        if self.parts == 1:
            sums = np.fromiter((self.checksum[s] for s in order.tolist()), dtype=np.uint64, count=len(order))
        else:  # each page's packed u64s: the checkpoint's ``n * parts`` column as it is
            packed = [self.checksum[s] for s in order.tolist()]
            sums = np.frombuffer(b"".join(c for c in packed if isinstance(c, bytes)), dtype=np.uint64)
            if len(sums) != len(order) * self.parts:
                raise ValueError(f"index holds pages of other than {self.parts} parts")  # recovery rules this out
        position = np.full(int(order.max(initial=-1)) + 1, -1, dtype=np.int64)
        position[order] = np.arange(len(order), dtype=np.int64)
        parent_slots = self.policy.parent_slots(order) if len(order) else np.zeros(0, np.int64)
        parents = np.where(parent_slots >= 0, position[np.where(parent_slots >= 0, parent_slots, 0)], -1)
        return keys, order, sums, parents
