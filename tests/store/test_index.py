"""The shard index's last-use times: age histograms and the quota's victims, in the policy's drop order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_kvtier.config import EvictionPolicyName
from sgl_kvtier.policy.quota import N_BUCKETS, bucket, bucket_floor
from sgl_kvtier.store.index import PageIndex
from sgl_kvtier.store.journal import Recovered

SLOT = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def k(n: int) -> bytes:
    return n.to_bytes(32, "little")


def index(policy: EvictionPolicyName, clock: Clock, recovered: Recovered | None = None, capacity: int = 64) -> PageIndex:
    return PageIndex(recovered or Recovered(), policy, capacity, clock=clock)


@pytest.mark.parametrize("policy", list(EvictionPolicyName))
def test_add_touch_and_remove_keep_last_use_times(policy):
    clock = Clock()
    idx = index(policy, clock)
    for n in range(4):
        idx.add(k(n), n, n, None)
        clock.now += 10
    assert [idx.last_used(k(n)) for n in range(4)] == [1000.0, 1010.0, 1020.0, 1030.0]
    idx.touch([k(0), k(99)])
    assert idx.last_used(k(0)) == 1040.0
    idx.remove(k(1))
    assert idx.last_used(k(1)) is None
    h = idx.age_histogram(clock.now, SLOT)
    assert len(h) == N_BUCKETS and sum(h) == 3 * SLOT
    assert h[0] == SLOT and h[bucket(10)] == SLOT and h[bucket(20)] == SLOT


@pytest.mark.parametrize("policy", list(EvictionPolicyName))
def test_victims_are_old_pages_coldest_first_up_to_the_limit(policy):
    clock = Clock()
    idx = index(policy, clock)
    for n in range(6):
        idx.add(k(n), n, n, None)
        clock.now += 10
    # ages now: 60, 50, 40, 30, 20, 10
    assert idx.victims_older_than(25.0, clock.now, 10 * SLOT, SLOT) == [k(0), k(1), k(2), k(3)]
    assert idx.victims_older_than(25.0, clock.now, 2 * SLOT, SLOT) == [k(0), k(1)]
    assert idx.victims_older_than(25.0, clock.now, SLOT + 1, SLOT) == [k(0), k(1)]  # reaches the limit
    assert idx.victims_older_than(100.0, clock.now, 10 * SLOT, SLOT) == []
    assert idx.victims_older_than(0.0, clock.now, 0, SLOT) == []
    idx.touch([k(0)])
    assert idx.victims_older_than(25.0, clock.now, 10 * SLOT, SLOT) == [k(1), k(2), k(3)]
    assert len(idx) == 6  # nothing removed


def test_chain_victims_are_deepest_first_and_ancestors_are_as_warm_as_their_tails():
    clock = Clock()
    idx = index(EvictionPolicyName.CHAIN, clock)
    idx.add(k(0), 0, 0, None)  # a head, never touched again
    clock.now += 100
    idx.add(k(1), 1, 1, k(0))
    idx.add(k(2), 2, 2, k(1))
    assert idx.last_used(k(0)) == idx.last_used(k(2))  # the tail lent its recency up the chain
    clock.now += 100
    idx.add(k(3), 3, 3, None)  # an unrelated young page
    assert idx.victims_older_than(50.0, clock.now, 10 * SLOT, SLOT) == [k(2), k(1), k(0)]
    assert idx.victims_older_than(50.0, clock.now, 2 * SLOT, SLOT) == [k(2), k(1)]
    # A young tail keeps its whole chain, however cold the head's own last use.
    idx.touch([k(2)])
    assert idx.victims_older_than(50.0, clock.now, 10 * SLOT, SLOT) == []
    h = idx.age_histogram(clock.now, SLOT)
    assert h[0] == 4 * SLOT


def test_a_reopened_index_starts_every_page_at_the_load_time():
    clock = Clock()
    rec = Recovered()
    for n in range(3):
        rec.slot_of[k(n)], rec.key_of[n], rec.checksum[n] = n, k(n), n
    rec.parent[1] = 0
    idx = index(EvictionPolicyName.CHAIN, clock, rec)
    assert all(idx.last_used(k(n)) == 1000.0 for n in range(3))
    clock.now += 30
    assert idx.age_histogram(clock.now, SLOT)[bucket(30)] == 3 * SLOT
    victims = idx.victims_older_than(10.0, clock.now, 10 * SLOT, SLOT)
    assert sorted(victims) == [k(0), k(1), k(2)] and victims.index(k(1)) < victims.index(k(0))


def test_slots_past_the_capacity_grow_the_times():
    clock = Clock()
    idx = index(EvictionPolicyName.LRU, clock, capacity=4)
    idx.add(k(1), 500, 1, None)
    assert idx.last_used(k(1)) == 1000.0
    assert sum(idx.age_histogram(clock.now, SLOT)) == SLOT


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 39), st.integers(0, 39)), min_size=1, max_size=120),
       st.floats(0, 200), st.integers(0, 40))
def test_chain_victims_never_take_a_page_before_its_descendants(ops, age, limit):
    """Random adds (on random stored parents), touches and removes: the victims form a valid drop order
    (each taken page has no stored child left by then) and are exactly old pages; the histogram agrees."""
    clock = Clock()
    idx = index(EvictionPolicyName.CHAIN, clock)
    for op, a, b in ops:
        clock.now += 3.0
        if op <= 1 and k(a) not in idx:
            parent = k(b) if k(b) in idx and b != a else None
            idx.add(k(a), a, a, parent)
        elif op == 2:
            idx.touch([k(a), k(b)])
        elif k(a) in idx:
            idx.remove(k(a))
    now = clock.now + 1.0
    victims = idx.victims_older_than(age, now, limit * SLOT, SLOT)
    assert len(victims) <= limit and len(set(victims)) == len(victims)
    taken: set[bytes] = set()
    children: dict[bytes, set[bytes]] = {}
    for key in list(idx.slot_of):
        parent = idx.parent_of(key)
        if parent is not None:
            children.setdefault(parent, set()).add(key)
    for key in victims:
        assert now - idx.last_used(key) >= age
        assert children.get(key, set()) <= taken  # every stored descendant already went
        taken.add(key)
    # Every page is at least as recent as its descendants (less the slack): old pages are evictable.
    for parent, kids in children.items():
        for kid in kids:
            assert idx.last_used(parent) >= idx.last_used(kid) - 0.5
    # With no limit, the victims are exactly the pages the histogram counts at or past the age's bucket.
    everything = idx.victims_older_than(bucket_floor(bucket(age)), now, 10 ** 6 * SLOT, SLOT)
    h = idx.age_histogram(now, SLOT)
    assert len(everything) * SLOT == sum(h[bucket(age):])

