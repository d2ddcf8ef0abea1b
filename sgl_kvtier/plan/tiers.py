"""One tier of the planner's model: blocks up to a token capacity, evicting with one of the store's policies.

The blocks are a trace's (``plan.trace``), each of a known token count, chaining on the block before it in
its request. Eviction is ``sgl_kvtier.policy.eviction``'s: ``chain`` (the store's default, and the rule
SGLang's radix tree follows in HBM and host memory: the least recently used leaf first) or ``lru``.
Invariant: ``used <= capacity`` after every ``admit``; a block larger than the whole tier is not admitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from sgl_kvtier.config import EvictionPolicyName
from sgl_kvtier.policy.eviction import make_policy


class Tier:
    """Blocks (by id) held within ``capacity`` tokens; ``evicted`` counts blocks dropped for room."""

    def __init__(self, capacity_tokens: int, policy: EvictionPolicyName = EvictionPolicyName.CHAIN) -> None:
        self.capacity = max(0, int(capacity_tokens))
        self.used = 0
        self.evicted = 0
        self._policy = make_policy(policy)
        self._slot: dict[int, int] = {}  # block id -> slot
        self._block: list[int] = []  # slot -> block id (-1: free)
        self._size: list[int] = []  # slot -> tokens
        self._free: list[int] = []

    def __contains__(self, block: int) -> bool:
        return block in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def prefix(self, blocks: Sequence[int], start: int = 0) -> int:
        """How many of ``blocks[start:]`` the tier holds, counted from ``start`` up to the first it lacks."""
        slot = self._slot
        n = start
        while n < len(blocks) and blocks[n] in slot:
            n += 1
        return n - start

    def touch(self, blocks: Sequence[int]) -> None:
        """The held ones of ``blocks`` (a chain, head first) were used now."""
        self._policy.touch([self._slot[b] for b in blocks if b in self._slot])

    def admit(self, blocks: Sequence[int], sizes: Sequence[int], parent: int | None = None) -> int:
        """Store ``blocks`` (a chain, head first, chaining on ``parent``) unless held, evicting for room;
        held ones are touched. Returns the tokens newly stored."""
        added = 0
        for block, size in zip(blocks, sizes):
            held = self._slot.get(block)
            if held is not None:
                self._policy.insert(held, self._slot.get(parent) if parent is not None else None)
            elif size <= self.capacity:
                self._make_room(size)
                slot = self._take(block, size)
                self._policy.insert(slot, self._slot.get(parent) if parent is not None else None)
                added += size
            parent = block
        return added

    def _make_room(self, size: int) -> None:
        while self.used + size > self.capacity:
            victim = self._policy.victim()
            if victim is None:  # pragma: no cover - used > 0 means a block is held
                raise RuntimeError("tier over capacity with nothing to evict")
            self._policy.remove(victim)
            del self._slot[self._block[victim]]
            self.used -= self._size[victim]
            self._block[victim] = -1
            self._free.append(victim)
            self.evicted += 1

    def _take(self, block: int, size: int) -> int:
        if self._free:
            slot = self._free.pop()
            self._block[slot], self._size[slot] = block, size
        else:
            slot = len(self._block)
            self._block.append(block)
            self._size.append(size)
        self._slot[block] = slot
        self.used += size
        return slot
