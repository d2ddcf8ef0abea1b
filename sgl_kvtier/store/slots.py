"""Slot bookkeeping: which global slots are free, in use, or pinned by a reader.

Global slot ``g`` lives on device ``g % n_devices`` at local slot ``g // n_devices``, so consecutive slots,
which a batch gets, stripe across devices. Free slots are handed out lowest first (a min-heap), then
never-used slots by raising ``high_water`` up to ``capacity``.

A slot being read is *pinned*. Evicting its page removes the key at once, but the slot is only reused
after the last reader unpins it; until then it is a zombie. Not thread-safe: the store's lock guards it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


class SlotTable:
    """Free, used and pinned global slots of one shard (see the module docstring)."""

    def __init__(self, capacity: int, used: Sequence[int] = ()):
        self.capacity = capacity
        taken = np.asarray(used, dtype=np.int64)
        taken = taken[taken < capacity]
        self.high_water = int(taken.max()) + 1 if taken.size else 0
        # A sorted list is a valid min-heap.
        self._free: list[int] = np.setdiff1d(np.arange(self.high_water, dtype=np.int64), taken).tolist()
        self._pins: dict[int, int] = {}
        self._zombies: set[int] = set()

    def allocate(self) -> int | None:
        """A free slot (lowest first), or None when every slot below ``capacity`` is taken."""
        while self._free:
            slot = heapq.heappop(self._free)
            if slot < self.capacity:
                return slot
        if self.high_water < self.capacity:
            self.high_water += 1
            return self.high_water - 1
        return None

    def release(self, slot: int) -> None:
        """The slot's page is gone; reuse it once no reader holds it."""
        if self._pins.get(slot):
            self._zombies.add(slot)
        elif slot < self.capacity:
            heapq.heappush(self._free, slot)

    def pin(self, slot: int) -> None:
        """A read of ``slot`` starts: the slot is not reused before the matching ``unpin``."""
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        """A read of ``slot`` ended; a slot released meanwhile is freed with its last reader."""
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
            return
        del self._pins[slot]
        if slot in self._zombies:
            self._zombies.discard(slot)
            self.release(slot)

    def pinned(self, slot: int) -> bool:
        """Whether a reader holds ``slot`` now."""
        return slot in self._pins

    def carry_pins(self, old: SlotTable) -> None:
        """Take over ``old``'s pins: this table replaces it while reads still hold slots of it."""
        for slot, count in old._pins.items():
            self._pins[slot] = self._pins.get(slot, 0) + count

    def shrink(self, capacity: int) -> None:
        """Stop handing out slots at or above ``capacity`` (a device ran out of space)."""
        self.capacity = min(self.capacity, capacity)

    @property
    def free_count(self) -> int:
        """Slots that ``allocate`` can still hand out."""
        return sum(1 for s in self._free if s < self.capacity) + max(0, self.capacity - self.high_water)
