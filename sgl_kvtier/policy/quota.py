"""One pool-wide byte quota shared by many writers, with no coordinator: a cooperative global LRU.

Pure arithmetic over the usages writers publish in their leases (``bytes_used``, ``age_hist``). Every writer,
every heartbeat, calls ``plan`` over all leases with itself as ``me`` and evicts only *its own* pages: the
oldest ``evict_bytes`` of those at least ``cutoff_age_s`` old. It allocates only while ``may_grow``. Ages
are bucketed on a log scale (bucket 0: [0, 1) s; bucket ``i``: [sqrt(2)**(i-1), sqrt(2)**i) s; the last:
older), one table of floors serving ``bucket``, ``buckets`` and ``bucket_floor`` alike.

The rule (``U`` = sum of ``bytes_used`` over every writer, live and dead; ``cap`` = capacity_bytes):
  * ``U <= high * cap``: nobody evicts (hysteresis: eviction, once started, goes down to ``low``).
  * Else ``U - low * cap`` bytes go, oldest bucket first, first from dead writers (histograms aged by
    ``seen_age_s``), then from live writers beyond each one's youngest ``min_share_bytes``. The cutoff
    bucket is shared pro rata, rounded up, so once all have evicted ``U <= low * cap`` (unless the floors
    exceed it).
  * ``may_grow``: ``U + grow_bytes <= cap``, or (a live newcomer) ``my bytes + grow_bytes <= min_share_bytes``.

Invariants: the plan depends on the set of usages, not their order (sorted by ``wid``, duplicates collapse
to the freshest, integer sums). Everyone reading the same leases gets the same cutoff and shares: live
histograms are taken as published (aging them would differ per observer's clock), so a writer plans with
exactly the usage it publishes. Shares add up to at least ``U - low * cap`` when eviction is due, never
exceed a writer's evictable bytes, and no live writer gives a byte while a dead one has any. A histogram
not adding up to ``bytes_used`` is reconciled: missing bytes count as age 0, surplus is dropped from the
youngest buckets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

N_BUCKETS = 64
BUCKET_BASE_S = 1.0
BUCKET_RATIO = math.sqrt(2.0)
# _FLOORS[i]: the youngest age in bucket i.
_FLOORS: tuple[float, ...] = (0.0, *(BUCKET_BASE_S * 2.0 ** ((i - 1) / 2) for i in range(1, N_BUCKETS)))
_FLOORS_NP = np.asarray(_FLOORS, dtype=np.float64)


def bucket(age_s: float) -> int:
    """The age bucket of ``age_s`` seconds (negative ages count as 0)."""
    return max(0, int(np.searchsorted(_FLOORS_NP, age_s, side="right")) - 1)


def bucket_floor(i: int) -> float:
    """The youngest age (s) in bucket ``i`` (0.0 for bucket 0)."""
    if not 0 <= i < N_BUCKETS:
        raise ValueError(f"age bucket {i} is outside 0..{N_BUCKETS - 1}")
    return _FLOORS[i]


def buckets(ages_s: np.ndarray) -> np.ndarray:
    """``bucket`` of many ages at once (an int64 array)."""
    out = np.searchsorted(_FLOORS_NP, np.asarray(ages_s, dtype=np.float64), side="right").astype(np.int64) - 1
    return np.maximum(out, 0)


def histogram(ages_s: np.ndarray, bytes_each: int) -> tuple[int, ...]:
    """Bytes per age bucket of pages of ``bytes_each`` bytes with these ages (a lease's ``age_hist``)."""
    counts = np.bincount(buckets(ages_s), minlength=N_BUCKETS)
    return tuple(int(c) * bytes_each for c in counts.tolist())


@dataclass(frozen=True, order=True)
class WriterUsage:
    """One writer's lease as an observer sees it.

    ``age_hist[i]``: bytes of its pages in age bucket ``i`` when the lease was written; ``seen_age_s``: how
    old that lease is on the observer's clock (0 for the observer itself; used for dead writers only)."""

    wid: str
    live: bool
    bytes_used: int
    age_hist: tuple[int, ...]
    seen_age_s: float = 0.0


@dataclass(frozen=True)
class QuotaPlan:
    """What one writer should do now (see the module docstring).

    ``cutoff_age_s``: evict own pages at least this old (None: evict nothing); ``evict_bytes``: how many of
    my bytes should go (the oldest of those past the cutoff); ``may_grow``: whether I may allocate new
    space. ``total_bytes`` (U) and ``target_bytes`` (what U should come down to) are for telemetry."""

    cutoff_age_s: float | None
    evict_bytes: int
    may_grow: bool
    total_bytes: int = 0
    target_bytes: int = 0


def _reconciled(u: WriterUsage) -> np.ndarray:
    """``u``'s histogram as N_BUCKETS ints adding up to ``bytes_used`` (see the module docstring)."""
    hist = np.zeros(N_BUCKETS, dtype=np.int64)
    raw = [max(0, int(b)) for b in u.age_hist]
    hist[:min(len(raw), N_BUCKETS)] = raw[:N_BUCKETS]
    hist[N_BUCKETS - 1] += sum(raw[N_BUCKETS:])  # a longer histogram: its tail is "older still"
    used = max(0, int(u.bytes_used))
    surplus = int(hist.sum()) - used
    if surplus < 0:
        hist[0] -= surplus
    for i in range(N_BUCKETS):  # surplus: drop from the youngest buckets
        if surplus <= 0:
            break
        take = min(surplus, int(hist[i]))
        hist[i] -= take
        surplus -= take
    return hist


def _aged(hist: np.ndarray, by_s: float) -> np.ndarray:
    """``hist`` as seen ``by_s`` seconds later with no touches: each bucket moves to bucket(floor + by_s)."""
    if not by_s > 0:
        return hist
    out = np.zeros_like(hist)
    np.add.at(out, buckets(_FLOORS_NP + by_s), hist)
    return out


def _floor_split(hist: np.ndarray, floor_bytes: int) -> tuple[np.ndarray, int]:
    """(evictable histogram, protected bytes): the youngest ``floor_bytes`` of ``hist`` are protected."""
    out = hist.copy()
    left = floor_bytes
    for i in range(N_BUCKETS):
        if left <= 0:
            break
        take = min(left, int(out[i]))
        out[i] -= take
        left -= take
    return out, floor_bytes - left


def _unique(usages: Iterable[WriterUsage]) -> list[WriterUsage]:
    """Usages sorted by wid, one per wid (the freshest lease; ties broken by the full record)."""
    best: dict[str, WriterUsage] = {}
    for u in usages:
        have = best.get(u.wid)
        if have is None or (u.seen_age_s, u) < (have.seen_age_s, have):
            best[u.wid] = u
    return [best[w] for w in sorted(best)]


def _class_shares(hists: Sequence[np.ndarray], need: int) -> tuple[list[int], int | None]:
    """Take ``need`` bytes from ``hists`` oldest bucket first, the cutoff bucket pro rata (rounded up).

    Returns (bytes taken from each histogram, the cutoff bucket or None when nothing is taken)."""
    shares = [0] * len(hists)
    if need <= 0 or not hists:
        return shares, None
    total = np.sum(np.stack(hists), axis=0)
    left = need
    for j in range(N_BUCKETS - 1, -1, -1):
        in_j = int(total[j])
        if not in_j:
            continue
        if in_j <= left:
            for w, h in enumerate(hists):
                shares[w] += int(h[j])
            left -= in_j
            if left == 0:
                return shares, j
            continue
        for w, h in enumerate(hists):  # the cutoff bucket: each gives its part of it, rounded up
            shares[w] += min(int(h[j]), -(-left * int(h[j]) // in_j))
        return shares, j
    return shares, 0  # everything goes and still short


def plan(usages: Iterable[WriterUsage], me: str, capacity_bytes: int, high: float = 0.95, low: float = 0.90,
         min_share_bytes: int = 0, grow_bytes: int = 0) -> QuotaPlan:
    """What writer ``me`` should do now under a pool quota of ``capacity_bytes`` (see the module docstring).

    ``usages``: every writer's usage (``me`` included; a missing ``me`` is a live newcomer with nothing);
    ``grow_bytes``: the size of one allocation (a slot or a segment) for ``may_grow``. A dead ``me`` (a
    reclaimer planning for a dead writer, see ``dead_writer_plan``) gets a cutoff of 0.0: its pages carry no
    meaningful ages in the reclaimer's index, so its share is simply its coldest ``evict_bytes``."""
    if not 0 < low <= high:
        raise ValueError(f"quota watermarks need 0 < low <= high, got low={low} high={high}")
    cap = max(0, int(capacity_bytes))
    floor = max(0, int(min_share_bytes))
    ws = _unique(usages)
    mine = next((u for u in ws if u.wid == me), None)
    if mine is None:
        mine = WriterUsage(me, True, 0, ())
        ws = _unique([*ws, mine])
    total = sum(max(0, int(u.bytes_used)) for u in ws)
    target = math.floor(low * cap)
    may_grow = total + grow_bytes <= cap or (mine.live and max(0, mine.bytes_used) + grow_bytes <= floor)
    if total <= high * cap:
        return QuotaPlan(None, 0, may_grow, total, total)

    dead_ws = [u for u in ws if not u.live]
    live_ws = [u for u in ws if u.live]
    dead_hists = [_aged(_reconciled(u), u.seen_age_s) for u in dead_ws]
    live_hists: list[np.ndarray] = []
    for u in live_ws:
        evictable, _ = _floor_split(_reconciled(u), floor)  # as published: see the module docstring
        live_hists.append(evictable)
    need = total - target
    dead_shares, dead_cut = _class_shares(dead_hists, need)
    live_shares, live_cut = _class_shares(live_hists, need - sum(dead_shares))

    if mine.live:
        share, cut = live_shares[live_ws.index(mine)], live_cut
        cutoff = None if cut is None or share == 0 else bucket_floor(cut)
    else:
        share = dead_shares[dead_ws.index(mine)]
        cutoff = None if dead_cut is None or share == 0 else 0.0
    return QuotaPlan(cutoff, share, may_grow, total, max(target, total - sum(dead_shares) - sum(live_shares)))


def dead_writer_plan(usages: Iterable[WriterUsage], dead_wid: str, capacity_bytes: int, high: float = 0.95,
                     low: float = 0.90, min_share_bytes: int = 0) -> QuotaPlan:
    """The share of dead writer ``dead_wid`` that a live reclaimer (the writer that took over its files)
    should evict now: drop that writer's coldest ``evict_bytes`` (its ``cutoff_age_s`` is 0.0 or None).
    ``may_grow`` is always False: a dead writer never allocates."""
    ws = list(usages)
    dead = [u for u in ws if u.wid == dead_wid]
    if not dead or any(u.live for u in dead):
        raise ValueError(f"writer {dead_wid!r} is not a dead writer among these usages")
    p = plan(ws, dead_wid, capacity_bytes, high, low, min_share_bytes)
    return QuotaPlan(p.cutoff_age_s, p.evict_bytes, False, p.total_bytes, p.target_bytes)
