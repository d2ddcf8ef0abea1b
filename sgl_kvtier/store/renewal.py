"""Fresh descriptors for a follower's reads of another writer's segments (``DescriptorRenewal``).

Some shared filesystems keep serving a descriptor the bytes a range held when it was opened after another
host rewrote that range in place (JuiceFS through FUSE does, for many seconds, with O_DIRECT and every client
cache off), while a fresh open sees the new bytes. A follower keeps its writer's segment files open, so its
view of a slot the writer reused would stay stale: every such page a miss for as long as it follows.

A FUSE client that died makes every descriptor of its mount answer ENOTCONN for good, also once the
filesystem is mounted again (``store.lost_handles``); a fresh open reaches the new mount.

So a peer's reads (``sharing.follower.PageReader`` with ``follows_peer``) carry a renewal. When pages fail
verification, or their reads fail through a lost descriptor, ``renew`` reopens the segment files behind them
and says which of them to read again; the read path (``store.transfer.PageIO.fresh_retry``, and
``store.part_reads`` for group-major reads) reads them once more through the fresh descriptor and serves
what verifies. Rules:
  * Only on a verification failure (a checksum or a short read) or an IO error that says the descriptor is
    lost (``store.transfer.renewable``), never on another IO error or a miss.
  * Bounded: one segment is reopened at most once per ``interval_s`` (the pool's follow interval); a burst
    of failures in one segment costs one open. A page whose segment was renewed in the interval already is
    not read again: a miss as before (a cluster follower keeps it as a suspect and tries it again later).
  * The fresh descriptor takes the old one's number (``Arena.reopen``: ``dup2``), so an op built or in
    flight on it stays valid: it reads through the old file or the new one, and is verified either way.
  * Never unverified bytes: a re-read is a read like any other, a hit only if every part passes.
Arenas that cannot reopen (a raw block device, a shared raw pool's region) renew nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from sgl_kvtier.store.layout import Layout
from sgl_kvtier.telemetry.counters import StoreCounters


class DescriptorRenewal:
    """Reopens a follower's segment files after pages in them failed verification (module docstring)."""

    def __init__(self, layout: Layout, counters: StoreCounters, interval_s: float,
                 clock: Callable[[], float] = time.monotonic):
        """``interval_s``: the least time between two reopenings of one segment (>= 0); ``clock``: seconds."""
        self.layout = layout
        self.counters = counters
        self.interval_s = max(0.0, interval_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple[int, int], float] = {}  # (device, segment) -> when it was last reopened

    def renew(self, slots: Sequence[int]) -> set[int]:
        """Of the global ``slots`` (pages that failed verification), those whose segment this call reopened:
        read them again. Each segment once per call, and only if it was not reopened in the last
        ``interval_s``. Never raises: a segment that cannot be opened again keeps its descriptor."""
        arenas = self.layout.arenas
        ndev = len(arenas)
        renewed: set[int] = set()
        with self._lock:
            now = self.clock()
            fresh: dict[tuple[int, int], bool] = {}
            for slot in slots:
                device, local = slot % ndev, slot // ndev
                segment = (device, arenas[device].segment_of(local))
                if segment not in fresh:
                    last = self._last.get(segment)
                    fresh[segment] = False
                    if last is None or now - last >= self.interval_s:
                        self._last[segment] = now  # a try, even a failed one: at most one per interval
                        try:
                            fresh[segment] = arenas[device].reopen(local)
                        except OSError:
                            fresh[segment] = False  # gone or unreadable now: the old descriptor serves misses
                        if fresh[segment]:
                            self.counters.segments_reopened += 1
                if fresh[segment]:
                    renewed.add(slot)
        return renewed
