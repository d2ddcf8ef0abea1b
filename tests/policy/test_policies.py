"""Eviction policies and write admission, as pure bookkeeping."""

from __future__ import annotations

from sgl_kvtier.policy.admission import AdmissionFilter
from sgl_kvtier.policy.eviction import ChainPolicy, LRUPolicy


def k(n: int) -> bytes:
    return n.to_bytes(32, "little")


def drain(policy, n):
    out = []
    for _ in range(n):
        v = policy.victim()
        out.append(int.from_bytes(v, "little"))
        policy.remove(v)
    return out


def test_lru_order_and_touch():
    p = LRUPolicy()
    for n in range(4):
        p.insert(k(n), None)
    p.touch([k(0)])
    assert drain(p, 4) == [1, 2, 3, 0]
    assert p.victim() is None


def test_chain_evicts_deepest_first_and_keeps_shared_heads():
    p = ChainPolicy()
    p.insert(k(0), None)  # shared head
    for n in (1, 2):
        p.insert(k(n), k(0))  # two branches off the head
    p.insert(k(3), k(1))
    p.touch([k(0), k(2)])  # branch 2 is hot
    # Leaves are 3 and 2; 3 is colder. Then 1 becomes a leaf with its own (old) recency; the head goes last.
    assert drain(p, 4) == [3, 1, 2, 0]


def test_chain_coldest_first_and_parent_links():
    p = ChainPolicy()
    p.insert(k(0), None)
    p.insert(k(1), k(0))
    assert p.parent_of(k(1)) == k(0) and p.coldest_first() == [k(0), k(1)]
    p.remove(k(0))
    p.insert(k(0), None)  # a new incarnation: the old child's link is stale
    assert p.parent_of(k(1)) is None
    p.remove(k(1))
    assert drain(p, 1) == [0]


def test_chain_heap_stays_bounded_under_many_touches():
    p = ChainPolicy()
    for n in range(10):
        p.insert(k(n), None)
    for _ in range(5000):
        p.touch([k(3)])
    assert len(p._leaves) <= 2 * 10 + 1024 + 1


def test_admission_counts_offers():
    f = AdmissionFilter(3, max_tracked=2)
    assert [f.offer(k(1)) for _ in range(3)] == [False, False, True]
    assert f.offer(k(1)) is False  # counting starts again once admitted
    f.offer(k(2)), f.offer(k(3)), f.offer(k(4))  # k(1)'s count ages out of the bounded map
    assert len(f._offers) <= 2
    assert AdmissionFilter(1).offer(k(9)) is True
