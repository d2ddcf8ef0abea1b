"""Eviction policies: which stored pages to drop when the store is full. Pure bookkeeping, no IO.

``LRUPolicy`` drops the least recently used page.

``ChainPolicy`` knows that SGLang keys form prefix chains (page i+1's hash chains on page i) and that a
chain is only usable up to its first missing page (``batch_exists`` stops there). So it only ever drops
*leaves* (pages no stored page chains on), least recently used first; a parent becomes a leaf, with its
own recency, once its last child is gone. A prefix is thus eaten from its deepest end and a shared head
outlives the many tails that hang off it. Leaves sit in a heap of (last use, key) with lazy deletion: a
heap entry is live only while its tick is the key's current one and the key still has no children.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterable, Protocol

from sgl_kvtier.config import EvictionPolicyName
from sgl_kvtier.keys import PageKey


class EvictionPolicy(Protocol):
    def insert(self, key: PageKey, parent: PageKey | None) -> None: ...

    def touch(self, keys: Iterable[PageKey]) -> None: ...

    def remove(self, key: PageKey) -> None: ...

    def victim(self) -> PageKey | None:
        """The next page to drop (not removed until ``remove`` is called), or None when empty."""
        ...

    def coldest_first(self) -> list[PageKey]: ...

    def parent_of(self, key: PageKey) -> PageKey | None: ...


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[PageKey, PageKey | None] = OrderedDict()

    def insert(self, key: PageKey, parent: PageKey | None) -> None:
        self._order[key] = parent
        self._order.move_to_end(key)

    def touch(self, keys: Iterable[PageKey]) -> None:
        # Touch a chain deepest-first so its head ends up the most recent: heads are worth more.
        for key in reversed(list(keys)):
            if key in self._order:
                self._order.move_to_end(key)

    def remove(self, key: PageKey) -> None:
        self._order.pop(key, None)

    def victim(self) -> PageKey | None:
        return next(iter(self._order), None)

    def coldest_first(self) -> list[PageKey]:
        return list(self._order)

    def parent_of(self, key: PageKey) -> PageKey | None:
        return self._order.get(key)


class ChainPolicy:
    def __init__(self) -> None:
        self._tick = 0
        self._last: dict[PageKey, int] = {}
        self._born: dict[PageKey, int] = {}
        # child -> (parent, parent's birth tick): a link to an earlier incarnation of a re-stored parent is stale
        self._parent: dict[PageKey, tuple[PageKey, int]] = {}
        self._children: dict[PageKey, int] = {}
        self._leaves: list[tuple[int, PageKey]] = []

    def _stamp(self, key: PageKey) -> None:
        self._tick += 1
        self._last[key] = self._tick
        if not self._children.get(key):
            heapq.heappush(self._leaves, (self._tick, key))
        if len(self._leaves) > 2 * len(self._last) + 1024:
            self._rebuild_heap()

    def insert(self, key: PageKey, parent: PageKey | None) -> None:
        if key in self._last:
            self._stamp(key)
            return
        if parent is not None and parent in self._last and parent != key:
            self._parent[key] = (parent, self._born[parent])
            self._children[parent] = self._children.get(parent, 0) + 1
        self._born[key] = self._tick + 1
        self._stamp(key)

    def touch(self, keys: Iterable[PageKey]) -> None:
        for key in reversed(list(keys)):
            if key in self._last:
                self._stamp(key)

    def remove(self, key: PageKey) -> None:
        if self._last.pop(key, None) is None:
            return
        self._children.pop(key, None)
        self._born.pop(key, None)
        parent, born = self._parent.pop(key, (None, None))
        if parent is not None and self._born.get(parent) == born:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
                heapq.heappush(self._leaves, (self._last[parent], parent))
        # Children of a removed page keep their place; they are unreachable through SGLang's prefix
        # lookups now, but they are leaves or ancestors of leaves and go in their turn.

    def victim(self) -> PageKey | None:
        while self._leaves:
            tick, key = self._leaves[0]
            if self._last.get(key) == tick and not self._children.get(key):
                return key
            heapq.heappop(self._leaves)
        if self._last:  # unreachable with acyclic parents; kept so a store can never wedge full
            return min(self._last, key=self._last.__getitem__)
        return None

    def coldest_first(self) -> list[PageKey]:
        return sorted(self._last, key=self._last.__getitem__)

    def parent_of(self, key: PageKey) -> PageKey | None:
        parent, born = self._parent.get(key, (None, None))
        return parent if parent is not None and self._born.get(parent) == born else None

    def _rebuild_heap(self) -> None:
        self._leaves = [(t, k) for k, t in self._last.items() if not self._children.get(k)]
        heapq.heapify(self._leaves)


def make_policy(name: EvictionPolicyName) -> EvictionPolicy:
    return ChainPolicy() if name is EvictionPolicyName.CHAIN else LRUPolicy()
