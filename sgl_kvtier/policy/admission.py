"""Write admission: spare flash by storing a page only once it has been offered ``threshold`` times.

Offer counts live in a bounded LRU map (``max_tracked`` keys), so one-off prompts age out without
growing memory. A threshold of 1 admits everything and tracks nothing.
"""

from __future__ import annotations

from collections import OrderedDict

from sgl_kvtier.keys import PageKey


class AdmissionFilter:
    """Admits a key on its ``threshold``-th offer; counts live in a bounded LRU map. Not thread-safe."""

    def __init__(self, threshold: int, max_tracked: int = 1 << 20):
        self.threshold = threshold
        self.max_tracked = max_tracked
        self._offers: OrderedDict[PageKey, int] = OrderedDict()

    def offer(self, key: PageKey) -> bool:
        """Count one offer of ``key``; True when it should be stored now."""
        if self.threshold <= 1:
            return True
        count = self._offers.pop(key, 0) + 1
        if count >= self.threshold:
            return True
        self._offers[key] = count
        if len(self._offers) > self.max_tracked:
            self._offers.popitem(last=False)
        return False
