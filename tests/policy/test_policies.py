"""Eviction policies and write admission, as pure bookkeeping over slots."""

from __future__ import annotations

import numpy as np

from sgl_kvtier.policy.admission import AdmissionFilter
from sgl_kvtier.policy.eviction import ChainPolicy, LRUPolicy


def k(n: int) -> bytes:
    return n.to_bytes(32, "little")


def drain(policy, n):
    out = []
    for _ in range(n):
        v = policy.victim()
        out.append(v)
        policy.remove(v)
    return out


def test_lru_order_and_touch():
    p = LRUPolicy()
    for n in range(4):
        p.insert(n, None)
    p.touch([0])
    assert drain(p, 4) == [1, 2, 3, 0]
    assert p.victim() is None


def test_chain_evicts_deepest_first_and_keeps_shared_heads():
    p = ChainPolicy(8)
    p.insert(0, None)  # shared head
    for n in (1, 2):
        p.insert(n, 0)  # two branches off the head
    p.insert(3, 1)
    p.touch([0, 2])  # branch 2 is hot
    # Leaves are 3 and 2; 3 is colder. Then 1 becomes a leaf with its own (old) recency; the head goes last.
    assert drain(p, 4) == [3, 1, 2, 0]
    assert p.victim() is None


def test_chain_coldest_first_and_parent_links():
    p = ChainPolicy(4)
    p.insert(0, None)
    p.insert(1, 0)
    assert p.parent_of(1) == 0 and p.coldest_first() == [0, 1]
    p.remove(0)
    p.insert(0, None)  # slot 0 reused by another page: the old child's link is stale
    assert p.parent_of(1) is None and p.parent_slots(np.array([1, 0])).tolist() == [-1, -1]
    p.remove(1)
    assert drain(p, 1) == [0]


def test_chain_grows_past_its_initial_capacity():
    p = ChainPolicy(2)
    for n in range(100):
        p.insert(n, n - 1 if n else None)
    assert p.parent_of(99) == 98
    assert drain(p, 3) == [99, 98, 97]


def test_bulk_load_links_children_listed_before_parents():
    """A checkpoint lists hot heads after cold tails; the links must survive a reopen."""
    p = ChainPolicy(8)
    p.bulk_load(np.array([5, 6, 7]), np.array([6, 7, -1]))  # 5 -> 6 -> 7, head 7 hottest
    assert p.parent_of(5) == 6 and p.parent_of(6) == 7
    assert p.parent_slots(np.array([5, 6, 7])).tolist() == [6, 7, -1]
    assert drain(p, 3) == [5, 6, 7]
    lru = LRUPolicy()
    lru.bulk_load(np.array([5, 6]), np.array([6, -1]))
    assert lru.parent_of(5) == 6 and lru.coldest_first() == [5, 6]


def test_chain_heap_stays_bounded_under_many_touches():
    p = ChainPolicy(16)
    for n in range(10):
        p.insert(n, None)
    for _ in range(5000):
        p.touch([3])
    assert len(p._leaves) <= 2 * 10 + 1024 + 1


def test_admission_counts_offers():
    f = AdmissionFilter(3, max_tracked=2)
    assert [f.offer(k(1)) for _ in range(3)] == [False, False, True]
    assert f.offer(k(1)) is False  # counting starts again once admitted
    f.offer(k(2)), f.offer(k(3)), f.offer(k(4))  # k(1)'s count ages out of the bounded map
    assert len(f._offers) <= 2
    assert AdmissionFilter(1).offer(k(9)) is True


def test_lru_victims_follow_its_order_and_skip_ineligible_pages():
    p = LRUPolicy()
    for n in range(5):
        p.insert(n, None)
    p.touch([1])
    eligible = np.array([True, True, False, True, True])
    assert p.victims(3, eligible) == [0, 3, 4]
    assert p.victims(10, np.ones(2, bool)) == [0, 1]  # slots past the mask are not eligible
    assert p.victims(0, eligible) == []
    assert p.coldest_first() == [0, 2, 3, 4, 1]  # unchanged


def test_chain_victims_replay_victim_and_remove_without_changing_anything():
    p = ChainPolicy(8)
    p.insert(0, None)
    p.insert(1, 0)
    p.insert(2, 1)
    p.insert(3, 0)
    p.insert(4, None)
    p.touch([4])
    everything = np.ones(8, bool)
    assert p.victims(10, everything) == drain(copy_of(p), 5)
    assert p.victims(10, everything) == [2, 1, 3, 0, 4]
    # An ineligible page keeps its ancestors; other chains still go.
    no_3 = everything.copy()
    no_3[3] = False
    assert p.victims(10, no_3) == [2, 1, 4]
    no_0 = everything.copy()
    no_0[0] = False
    assert p.victims(10, no_0) == [2, 1, 3, 4]
    assert p.victims(2, everything) == [2, 1]
    assert p.victim() == 2 and p.coldest_first() == [0, 1, 2, 3, 4]  # unchanged


def copy_of(p: ChainPolicy) -> ChainPolicy:
    order = np.asarray(p.coldest_first(), np.int64)
    q = ChainPolicy(8)
    q.bulk_load(order, p.parent_slots(order))
    return q
