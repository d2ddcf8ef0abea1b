"""When a lookup that fell short reads the other writers again before it answers: one rule for every view of a
pool (a ``SharedPool``'s peers, ``sharing.peers``; a ``SoleShard`` reader's writer, ``sharing.sole``), whoever
asks (``longest_prefix``, the v1 existence query; a side pool's part of the v2 one, ``sglang.side_pools``).

A lookup *falls short* when the view holds less than it asked for. Before it answers then:
  * a retry (it asks again for what a lookup of this view answered short; named by the last key asked, the
    last ``REMEMBERED`` such kept) always refreshes: it sees every page another writer committed before it,
    those committed since its miss included;
  * any other refreshes unless one did within the last ``follow_interval_s / 4``: it answers from a view at
    most that old.
A refresh due waits up to ``SHORTFALL_WAIT_S`` for one another thread is running, then runs its own (begun
after the lookup was). The cost is bounded: a refresh per retry (SGLang paces and caps them), and at most one
per quarter interval for the rest.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from sgl_kvtier.keys import PageKey

SHORTFALL_WAIT_S = 1.0  # a lookup falling short waits this long for another thread's refresh
REMEMBERED = 4096  # lookups answered short kept, to know their retries


class Shortfalls:
    """Whether a lookup of one view that fell short refreshes the view first (see the module docstring).
    ``interval_s``: the view's ``follow_interval_s``; ``clock``: its clock."""

    def __init__(self, interval_s: float, clock: Callable[[], float], remembered: int = REMEMBERED):
        self.interval_s = interval_s
        self.clock = clock
        self.remembered = remembered
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._short: OrderedDict[PageKey, None] = OrderedDict()  # last key of each lookup answered short

    def due(self, asked: Sequence[PageKey]) -> bool:
        """A lookup of ``asked`` fell short: whether it refreshes the view before answering (a retry always,
        any other at most every quarter interval). It is remembered as answered short either way."""
        name = asked[-1] if len(asked) and isinstance(asked[-1], bytes) else None
        now = self.clock()
        with self._lock:
            retry = name is not None and name in self._short
            if name is not None:
                self._short[name] = None
                self._short.move_to_end(name)
                while len(self._short) > self.remembered:
                    self._short.popitem(last=False)
            if not retry and now - self._last < self.interval_s / 4:
                return False
            self._last = now
            return True
