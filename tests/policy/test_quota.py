"""The pool quota's plan: a cooperative global LRU that every writer computes alike from the leases."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_kvtier.policy import quota
from sgl_kvtier.policy.quota import N_BUCKETS, QuotaPlan, WriterUsage, bucket, bucket_floor, plan

MiB = 1 << 20
PAGE = 4096


def hist(**by_bucket: int) -> tuple[int, ...]:
    """A histogram from ``b<i>=bytes`` keywords."""
    out = [0] * N_BUCKETS
    for name, n in by_bucket.items():
        out[int(name[1:])] = n
    return tuple(out)


def usage(wid: str, h: tuple[int, ...], live: bool = True, seen: float = 0.0) -> WriterUsage:
    return WriterUsage(wid, live, sum(h), h, seen)


def evict(h: tuple[int, ...], cutoff: float | None, n: int) -> tuple[int, ...]:
    """What a writer's histogram becomes after it evicts ``n`` bytes past ``cutoff``, oldest first."""
    out = list(h)
    if cutoff is None:
        return h
    for i in range(N_BUCKETS - 1, bucket(cutoff) - 1, -1):
        take = min(n, out[i])
        out[i] -= take
        n -= take
    return tuple(out)


# ------------------------------------------------------------------------------------------ buckets
def test_buckets_are_log_scale_and_agree_with_their_floors():
    assert bucket(0) == 0 and bucket(0.999) == 0 and bucket(-5) == 0
    assert bucket(1.0) == 1 and bucket(1.41) == 1 and bucket(1.42) == 2 and bucket(2.0) == 3
    assert bucket(1e30) == N_BUCKETS - 1
    assert bucket_floor(0) == 0.0 and bucket_floor(1) == 1.0 and bucket_floor(3) == pytest.approx(2.0)
    for i in range(N_BUCKETS):
        assert bucket(bucket_floor(i)) == i
        if i:
            assert bucket(bucket_floor(i) * (1 - 1e-9)) == i - 1
    with pytest.raises(ValueError):
        bucket_floor(N_BUCKETS)


def test_histogram_of_ages():
    import numpy as np
    h = quota.histogram(np.array([0.1, 0.2, 1.5, 100.0]), PAGE)
    assert len(h) == N_BUCKETS and sum(h) == 4 * PAGE
    assert h[0] == 2 * PAGE and h[bucket(1.5)] == PAGE and h[bucket(100.0)] == PAGE


# ----------------------------------------------------------------------------------------- examples
def test_no_eviction_under_the_high_watermark():
    us = [usage("a", hist(b20=40 * MiB)), usage("b", hist(b3=54 * MiB))]
    p = plan(us, "a", 100 * MiB, grow_bytes=PAGE)
    assert p == QuotaPlan(None, 0, True, 94 * MiB, 94 * MiB)
    full = [usage("a", hist(b20=40 * MiB)), usage("b", hist(b3=60 * MiB))]
    assert plan(full, "a", 100 * MiB, grow_bytes=PAGE).may_grow is False  # at the cap: no new space


def test_the_oldest_bytes_go_whoever_holds_them():
    # 120 MiB on a 100 MiB pool: 30 MiB must go to reach 90. a holds the oldest 20, b the next.
    us = [usage("a", hist(b30=20 * MiB, b2=20 * MiB)), usage("b", hist(b25=40 * MiB, b1=40 * MiB))]
    pa, pb = plan(us, "a", 100 * MiB), plan(us, "b", 100 * MiB)
    assert (pa.evict_bytes, pa.cutoff_age_s) == (20 * MiB, bucket_floor(25))
    assert (pb.evict_bytes, pb.cutoff_age_s) == (10 * MiB, bucket_floor(25))
    assert not pa.may_grow and pa.total_bytes == 120 * MiB and pa.target_bytes == 90 * MiB


def test_the_cutoff_bucket_is_shared_pro_rata_not_wiped():
    # Everything written in one burst (one bucket): only the excess goes, split by size.
    us = [usage("a", hist(b10=72 * MiB)), usage("b", hist(b10=24 * MiB))]
    pa, pb = plan(us, "a", 100 * MiB), plan(us, "b", 100 * MiB)
    assert pa.evict_bytes + pb.evict_bytes >= 6 * MiB
    assert pa.evict_bytes == pytest.approx(4.5 * MiB, abs=1) and pb.evict_bytes == pytest.approx(1.5 * MiB, abs=1)


def test_dead_writers_go_first_aged_by_their_lease_age():
    dead = usage("d", hist(b2=20 * MiB), live=False, seen=3600.0)
    live = usage("a", hist(b40=80 * MiB))  # far older than the dead one's lease said
    assert plan([dead, live], "a", 100 * MiB, grow_bytes=PAGE) == QuotaPlan(None, 0, False, 100 * MiB, 90 * MiB)
    d = quota.dead_writer_plan([dead, live], "d", 100 * MiB)
    assert d.evict_bytes == 10 * MiB and d.cutoff_age_s == 0.0 and not d.may_grow
    # Two dead writers: the one dead longer goes first.
    older = usage("e", hist(b2=20 * MiB), live=False, seen=7200.0)
    us = [dead, older, usage("a", hist(b1=70 * MiB))]
    assert quota.dead_writer_plan(us, "e", 100 * MiB).evict_bytes == 20 * MiB
    assert quota.dead_writer_plan(us, "d", 100 * MiB).evict_bytes == 0
    with pytest.raises(ValueError):
        quota.dead_writer_plan(us, "a", 100 * MiB)


def test_a_live_lease_counts_as_published_whenever_it_is_read():
    us = [usage("a", hist(b30=20 * MiB, b2=20 * MiB)), usage("b", hist(b25=40 * MiB, b1=40 * MiB))]
    later = [usage("a", hist(b30=20 * MiB, b2=20 * MiB), seen=5.0), usage("b", hist(b25=40 * MiB, b1=40 * MiB), seen=9.0)]
    assert all(plan(us, w, 100 * MiB) == plan(later, w, 100 * MiB) for w in "ab")


def test_a_newcomer_gets_its_min_share_and_writers_keep_their_floor():
    full = [usage("a", hist(b30=100 * MiB))]
    p = plan(full, "new", 100 * MiB, min_share_bytes=8 * MiB, grow_bytes=PAGE)
    assert p.may_grow and p.evict_bytes == 0 and p.cutoff_age_s is None
    assert not plan(full, "new", 100 * MiB, grow_bytes=PAGE).may_grow  # no floor: it waits for room
    # The newcomer's young pages are its floor: the old writer pays for all of it.
    us = [*full, usage("new", hist(b0=8 * MiB))]
    assert plan(us, "new", 100 * MiB, min_share_bytes=8 * MiB).evict_bytes == 0
    assert plan(us, "a", 100 * MiB, min_share_bytes=8 * MiB).evict_bytes == 18 * MiB
    # The floor holds even when the floored writer's pages are the oldest.
    small = [usage("a", hist(b1=96 * MiB)), usage("s", hist(b50=4 * MiB))]
    assert plan(small, "s", 100 * MiB, min_share_bytes=8 * MiB).evict_bytes == 0
    assert plan(small, "a", 100 * MiB, min_share_bytes=8 * MiB).evict_bytes == 10 * MiB


def test_histograms_that_do_not_add_up_are_reconciled():
    # 30 MiB used but only 10 in the histogram: the missing 20 count as young.
    short = WriterUsage("a", True, 30 * MiB, hist(b40=10 * MiB))
    us = [short, usage("b", hist(b1=70 * MiB))]
    assert plan(us, "a", 100 * MiB).evict_bytes == 10 * MiB
    long = WriterUsage("a", True, 10 * MiB, hist(b40=10 * MiB, b0=30 * MiB))  # surplus: dropped from the young end
    assert plan([long, usage("b", hist(b1=90 * MiB))], "a", 100 * MiB).evict_bytes == 10 * MiB
    odd = WriterUsage("a", True, 100 * MiB, (1,) * (N_BUCKETS + 8))  # too long a histogram: no crash
    assert plan([odd], "a", 100 * MiB).evict_bytes >= 10 * MiB


def test_bad_watermarks_are_refused():
    with pytest.raises(ValueError):
        plan([], "a", MiB, high=0.8, low=0.9)


# ------------------------------------------------------------------------------------------ properties
hists = st.lists(st.integers(0, 64), min_size=N_BUCKETS, max_size=N_BUCKETS).map(
    lambda xs: tuple(x * PAGE for x in xs))
writers = st.lists(st.tuples(hists, st.booleans(), st.floats(0, 1e5)), min_size=1, max_size=6)


def as_usages(ws) -> list[WriterUsage]:
    return [usage(f"w{i}", h, live, seen if not live else 0.0) for i, (h, live, seen) in enumerate(ws)]


@settings(max_examples=150, deadline=None)
@given(writers, st.integers(1, 4000), st.integers(0, 20))
def test_every_writer_evicting_its_share_brings_the_pool_under_low(ws, cap_pages, floor_pages):
    us = as_usages(ws)
    cap, floor = cap_pages * PAGE, floor_pages * PAGE
    total = sum(u.bytes_used for u in us)
    plans = {u.wid: plan(us, u.wid, cap, min_share_bytes=floor) for u in us}
    after = 0
    for u in us:
        p = plans[u.wid]
        assert 0 <= p.evict_bytes <= u.bytes_used
        if u.live and u.bytes_used <= floor:
            assert p.evict_bytes == 0
        if total <= 0.95 * cap:
            assert p.evict_bytes == 0 and p.cutoff_age_s is None
        past = 0 if p.cutoff_age_s is None else sum(u.age_hist[bucket(p.cutoff_age_s):]) if u.live else u.bytes_used
        assert p.evict_bytes <= past  # only pages past the cutoff are asked for
        after += u.bytes_used - p.evict_bytes
    protected = sum(min(u.bytes_used, floor) for u in us if u.live)
    if total > 0.95 * cap:
        assert after <= max(int(0.9 * cap), protected)
        if protected <= 0.9 * cap:
            assert after <= cap


@settings(max_examples=100, deadline=None)
@given(writers, st.integers(1, 4000), st.integers(0, 2 ** 32))
def test_the_plan_ignores_the_order_of_usages(ws, cap_pages, seed):
    us = as_usages(ws)
    shuffled = list(us)
    random.Random(seed).shuffle(shuffled)
    for u in us:
        assert plan(us, u.wid, cap_pages * PAGE) == plan(shuffled, u.wid, cap_pages * PAGE)


@settings(max_examples=100, deadline=None)
@given(writers, st.integers(1, 4000))
def test_no_live_byte_goes_while_a_dead_one_stays(ws, cap_pages):
    us = as_usages(ws)
    cap = cap_pages * PAGE
    live_evict = sum(plan(us, u.wid, cap).evict_bytes for u in us if u.live)
    dead_left = sum(u.bytes_used - plan(us, u.wid, cap).evict_bytes for u in us if not u.live)
    assert live_evict == 0 or dead_left == 0


@settings(max_examples=100, deadline=None)
@given(writers, st.integers(1, 4000))
def test_older_pages_go_before_younger_ones_across_writers(ws, cap_pages):
    """No live writer keeps a byte older than the cutoff bucket while another gives one from it."""
    us = [u for u in as_usages(ws) if u.live]
    cap = cap_pages * PAGE
    cuts = {plan(us, u.wid, cap).cutoff_age_s for u in us} - {None}
    assert len(cuts) <= 1  # one cutoff for everyone
    if cuts:
        j = bucket(cuts.pop())
        for u in us:
            p = plan(us, u.wid, cap)
            assert p.evict_bytes >= sum(u.age_hist[j + 1:])  # everything past the cutoff bucket goes
            assert evict(u.age_hist, p.cutoff_age_s, p.evict_bytes)[j + 1:] == (0,) * (N_BUCKETS - j - 1)
