"""The in-memory index of one shard: key <-> slot, page checksums, and the eviction policy, kept in step.

Built from ``journal.Recovered`` (its dicts are taken over, not copied: a million pages load in well
under a second). Not thread-safe: the page store's lock guards every call.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from sgl_kvtier.config import EvictionPolicyName
from sgl_kvtier.keys import PageKey
from sgl_kvtier.policy.eviction import make_policy
from sgl_kvtier.store.journal import Recovered


class PageIndex:
    """key <-> slot, each slot's checksum, and the eviction policy over the slots (see the module docstring)."""

    def __init__(self, recovered: Recovered, eviction: EvictionPolicyName, capacity: int):
        self._eviction = eviction
        self._capacity = capacity
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
        slots = np.fromiter(self.slot_of.values(), dtype=np.int64, count=len(self.slot_of))
        by_slot = np.full(int(slots.max(initial=-1)) + 1, -1, dtype=np.int64)
        if recovered.parent:
            by_slot[np.fromiter(recovered.parent.keys(), np.int64)] = np.fromiter(recovered.parent.values(), np.int64)
        parents = by_slot[slots]
        self.policy = make_policy(self._eviction, max(self._capacity, int(slots.max(initial=-1)) + 1))
        self.policy.bulk_load(slots, parents)

    def __contains__(self, key: PageKey) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def slots(self) -> list[int]:
        """Every slot in use."""
        return list(self.slot_of.values())

    def lookup(self, key: PageKey) -> tuple[int, int] | None:
        """``(slot, checksum)`` of a stored page, or None."""
        slot = self.slot_of.get(key)
        return None if slot is None else (slot, self.checksum[slot])

    def add(self, key: PageKey, slot: int, checksum: int, parent: PageKey | None) -> None:
        """Index a page written to ``slot``; ``parent`` (if stored) is the page it chains on."""
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.checksum[slot] = checksum
        self.policy.insert(slot, self.slot_of.get(parent) if parent is not None else None)

    def remove(self, key: PageKey) -> int:
        """Unindex a stored page; its slot (the caller frees it)."""
        slot = self.slot_of.pop(key)
        del self.key_of[slot]
        del self.checksum[slot]
        self.policy.remove(slot)
        return slot

    def touch(self, keys: Iterable[PageKey]) -> None:
        """Mark pages used now (a chain's keys in order); unknown keys are ignored."""
        self.policy.touch([self.slot_of[k] for k in keys if k in self.slot_of])

    def victim(self) -> PageKey | None:
        """The page the policy would evict next, or None when empty."""
        slot = self.policy.victim()
        return None if slot is None else self.key_of[slot]

    def parent_of(self, key: PageKey) -> PageKey | None:
        """The stored page ``key`` chains on, or None."""
        parent = self.policy.parent_of(self.slot_of[key])
        return None if parent is None else self.key_of[parent]

    def snapshot(self) -> tuple[list[PageKey], np.ndarray, np.ndarray, np.ndarray]:
        """(keys, slots, checksums, parent positions) coldest first, for a checkpoint."""
        order = np.asarray(self.policy.coldest_first(), dtype=np.int64)
        keys = [self.key_of[s] for s in order.tolist()]
        sums = np.fromiter((self.checksum[s] for s in order.tolist()), dtype=np.uint64, count=len(order))
        position = np.full(int(order.max(initial=-1)) + 1, -1, dtype=np.int64)
        position[order] = np.arange(len(order), dtype=np.int64)
        parent_slots = self.policy.parent_slots(order) if len(order) else np.zeros(0, np.int64)
        parents = np.where(parent_slots >= 0, position[np.where(parent_slots >= 0, parent_slots, 0)], -1)
        return keys, order, sums, parents
