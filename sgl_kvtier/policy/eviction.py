"""Eviction policies: which stored page to drop when the store is full. Pure bookkeeping, no IO.

Pages are named by slot (a small int, unique while the page is stored), so state is a few numpy arrays,
not a Python object per page. ``LRUPolicy`` drops the least recently used page. ``ChainPolicy`` knows SGLang
keys form prefix chains usable only up to their first missing page, so it drops only *leaves* (pages no
stored page chains on), least recently used first; a parent becomes a leaf, with its own recency, once its
last child is gone. A prefix is eaten from its deepest end and a shared head outlives its tails.
``coldest_first`` is recency order (a checkpoint's); ``victims`` is the real drop order (never a page before
a stored descendant). Leaves sit in a heap of ``tick << 32 | slot`` with lazy deletion (an entry is live
only while its tick is the slot's current one and the slot has no children); a child's link records its
parent's birth tick, so a link to a since-reused slot is ignored.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from sgl_kvtier.config import EvictionPolicyName

_SLOT_BITS = 32
_SLOT_MASK = (1 << _SLOT_BITS) - 1


class EvictionPolicy(Protocol):
    """What the index asks of an eviction policy; pages are named by slot. Not thread-safe."""

    def insert(self, slot: int, parent: int | None) -> None:
        """A page was stored in ``slot``, chaining on the page in ``parent`` (None: a chain head)."""
        ...

    def touch(self, slots: Iterable[int]) -> None:
        """Pages were used now (a chain's slots in order, head first)."""
        ...

    def remove(self, slot: int) -> None:
        """The page in ``slot`` is gone (unknown slots are ignored)."""
        ...

    def victim(self) -> int | None:
        """The slot of the next page to drop (not removed until ``remove``), or None when empty."""
        ...

    def coldest_first(self) -> list[int]:
        """Every stored slot, next victim first (a checkpoint's order)."""
        ...

    def victims(self, count: int, eligible: np.ndarray) -> list[int]:
        """Up to ``count`` slots in the order repeated ``victim()`` + ``remove()`` would drop them, changing
        nothing, skipping slots where ``eligible`` (a bool array by slot; slots past its end are not eligible)
        is False: such a page is kept, and under the chain policy so are all its ancestors."""
        ...

    def parent_of(self, slot: int) -> int | None:
        """The slot of the stored page ``slot`` chains on, or None."""
        ...

    def parent_slots(self, slots: np.ndarray) -> np.ndarray:
        """``parent_of`` for many slots at once (-1 for none)."""
        ...

    def bulk_load(self, slots: np.ndarray, parents: np.ndarray) -> None:
        """Replace the state: ``slots`` coldest first, ``parents[i]`` the parent slot of ``slots[i]`` or -1."""
        ...


class LRUPolicy:
    """Drops the least recently used page."""

    def __init__(self, capacity: int = 0) -> None:
        self._order: OrderedDict[int, int | None] = OrderedDict()

    def insert(self, slot: int, parent: int | None) -> None:
        self._order[slot] = parent
        self._order.move_to_end(slot)

    def touch(self, slots: Iterable[int]) -> None:
        # Touch a chain deepest-first so its head ends up the most recent: heads are worth more.
        for slot in reversed(list(slots)):
            if slot in self._order:
                self._order.move_to_end(slot)

    def remove(self, slot: int) -> None:
        self._order.pop(slot, None)

    def victim(self) -> int | None:
        return next(iter(self._order), None)

    def coldest_first(self) -> list[int]:
        return list(self._order)

    def victims(self, count: int, eligible: np.ndarray) -> list[int]:
        out: list[int] = []
        n = len(eligible)
        for slot in self._order:
            if len(out) >= count:
                break
            if slot < n and eligible[slot]:
                out.append(slot)
        return out

    def parent_of(self, slot: int) -> int | None:
        parent = self._order.get(slot)
        return parent if parent is not None and parent in self._order else None

    def parent_slots(self, slots: np.ndarray) -> np.ndarray:
        return np.array([-1 if (p := self.parent_of(int(s))) is None else p for s in slots], dtype=np.int64)

    def bulk_load(self, slots: np.ndarray, parents: np.ndarray) -> None:
        self._order = OrderedDict(zip(slots.tolist(), [p if p >= 0 else None for p in parents.tolist()]))


class ChainPolicy:
    """Drops the least recently used *leaf* of the prefix chains (see the module docstring)."""

    def __init__(self, capacity: int = 0) -> None:
        self._tick = 0
        self._alloc(max(capacity, 16))
        self._leaves: list[int] = []
        self._count = 0

    def _alloc(self, n: int) -> None:
        self._last = np.zeros(n, np.int64)  # 0: not stored
        self._born = np.zeros(n, np.int64)
        self._parent = np.full(n, -1, np.int64)
        self._parent_born = np.zeros(n, np.int64)
        self._children = np.zeros(n, np.int32)

    def _fit(self, slot: int) -> None:
        if slot >= len(self._last):
            old = self._arrays()
            self._alloc(max(slot + 1, 2 * len(self._last)))
            for new, prev in zip(self._arrays(), old):
                new[:len(prev)] = prev

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return self._last, self._born, self._parent, self._parent_born, self._children

    def _stamp(self, slot: int) -> None:
        self._tick += 1
        self._last[slot] = self._tick
        if not self._children[slot]:
            heapq.heappush(self._leaves, self._tick << _SLOT_BITS | slot)
        if len(self._leaves) > 2 * self._count + 1024:
            self._rebuild_heap()

    def insert(self, slot: int, parent: int | None) -> None:
        self._fit(slot)
        if self._last[slot]:
            self._stamp(slot)
            return
        self._count += 1
        if parent is not None and parent != slot and parent < len(self._last) and self._last[parent]:
            self._parent[slot] = parent
            self._parent_born[slot] = self._born[parent]
            self._children[parent] += 1
        self._born[slot] = self._tick + 1
        self._stamp(slot)

    def touch(self, slots: Iterable[int]) -> None:
        for slot in reversed(list(slots)):
            if slot < len(self._last) and self._last[slot]:
                self._stamp(slot)

    def remove(self, slot: int) -> None:
        if slot >= len(self._last) or not self._last[slot]:
            return
        self._count -= 1
        self._last[slot] = 0
        self._children[slot] = 0
        parent = int(self._parent[slot])
        self._parent[slot] = -1
        if parent >= 0 and self._last[parent] and self._born[parent] == self._parent_born[slot]:
            self._children[parent] -= 1
            if not self._children[parent]:
                heapq.heappush(self._leaves, int(self._last[parent]) << _SLOT_BITS | parent)
        # Children of a removed page keep their place; they are unreachable through SGLang's prefix
        # lookups now, but they are leaves or ancestors of leaves and go in their turn.

    def victim(self) -> int | None:
        while self._leaves:
            item = self._leaves[0]
            slot, tick = item & _SLOT_MASK, item >> _SLOT_BITS
            if self._last[slot] == tick and not self._children[slot]:
                return slot
            heapq.heappop(self._leaves)
        if self._count:  # unreachable with acyclic parents; kept so a store can never wedge full
            live = np.flatnonzero(self._last)
            return int(live[np.argmin(self._last[live])])
        return None

    def coldest_first(self) -> list[int]:
        live = np.flatnonzero(self._last)
        order: list[int] = live[np.argsort(self._last[live], kind="stable")].tolist()
        return order

    def victims(self, count: int, eligible: np.ndarray) -> list[int]:
        # Replays victim()/remove() on a private heap of the eligible leaves; a parent joins it once its
        # last child is taken, and only if it is eligible itself (an ineligible page keeps its ancestors).
        if count <= 0:
            return []
        mask = np.zeros(len(self._last), dtype=bool)
        m = min(len(mask), len(eligible))
        mask[:m] = np.asarray(eligible[:m], dtype=bool)
        live = np.flatnonzero((self._last > 0) & (self._children == 0) & mask)
        heap: list[int] = np.sort(self._last[live] << _SLOT_BITS | live).tolist()  # sorted: a valid heap
        children: dict[int, int] = {}
        out: list[int] = []
        while heap and len(out) < count:
            slot = heapq.heappop(heap) & _SLOT_MASK
            out.append(slot)
            parent = self.parent_of(slot)
            if parent is None or not mask[parent]:
                continue
            left = children.get(parent, int(self._children[parent])) - 1
            children[parent] = left
            if not left:
                heapq.heappush(heap, int(self._last[parent]) << _SLOT_BITS | parent)
        return out

    def parent_of(self, slot: int) -> int | None:
        if slot >= len(self._last) or not self._last[slot]:
            return None
        parent = int(self._parent[slot])
        if parent >= 0 and self._last[parent] and self._born[parent] == self._parent_born[slot]:
            return parent
        return None

    def parent_slots(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots, np.int64)
        parents = self._parent[slots]
        safe = np.where(parents >= 0, parents, 0)
        valid = (parents >= 0) & (self._last[safe] > 0) & (self._born[safe] == self._parent_born[slots])
        return np.where(valid, parents, -1)

    def bulk_load(self, slots: np.ndarray, parents: np.ndarray) -> None:
        # A checkpoint lists hot heads after their cold tails, so a parent may come after its child:
        # links are made with every slot known. Ticks follow the order, so the leaves already form a heap.
        slots = np.asarray(slots, np.int64)
        parents = np.asarray(parents, np.int64)
        n = len(slots)
        self._alloc(max(len(self._last), int(slots.max(initial=-1)) + 1))
        ticks = np.arange(1, n + 1, dtype=np.int64)
        self._last[slots] = ticks
        self._born[slots] = ticks
        linked = (parents >= 0) & (parents != slots)
        linked &= self._last[np.where(linked, parents, 0)] > 0
        self._parent[slots[linked]] = parents[linked]
        self._parent_born[slots[linked]] = self._born[parents[linked]]
        np.add.at(self._children, parents[linked], 1)
        leaves = self._children[slots] == 0
        self._leaves = (ticks[leaves] << _SLOT_BITS | slots[leaves]).tolist()
        self._tick, self._count = n, n

    def _rebuild_heap(self) -> None:
        live = np.flatnonzero((self._last > 0) & (self._children == 0))
        self._leaves = (self._last[live] << _SLOT_BITS | live).tolist()
        heapq.heapify(self._leaves)


def make_policy(name: EvictionPolicyName, capacity: int = 0) -> EvictionPolicy:
    """The policy ``name`` names, sized for ``capacity`` slots (it grows past them if needed)."""
    return ChainPolicy(capacity) if name is EvictionPolicyName.CHAIN else LRUPolicy(capacity)
