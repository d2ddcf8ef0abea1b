"""plan.tiers: a token-capacity tier over the store's eviction policies."""

from __future__ import annotations

from sgl_kvtier.config import EvictionPolicyName
from sgl_kvtier.plan.tiers import Tier


def test_capacity_holds_and_the_chain_policy_eats_tails_first() -> None:
    tier = Tier(4 * 32)
    assert tier.admit([1, 2, 3], [32, 32, 32]) == 96
    assert tier.admit([9], [32]) == 32 and tier.used == 128
    tier.touch([9])
    tier.admit([1, 2, 3, 4], [32, 32, 32, 32])  # 4 needs room: the coldest leaf is 9, not the chain's head
    assert 9 not in tier and all(b in tier for b in (1, 2, 3, 4))
    tier.admit([7], [32])  # then the chain's deepest page goes, never its head
    assert 4 not in tier and 1 in tier and tier.used <= tier.capacity and tier.evicted == 2


def test_lru_policy_drops_the_least_recent() -> None:
    tier = Tier(2 * 10, EvictionPolicyName.LRU)
    tier.admit([1, 2], [10, 10])
    tier.touch([1])
    tier.admit([3], [10])
    assert 2 not in tier and 1 in tier and 3 in tier


def test_prefix_stops_at_the_first_missing_block_and_oversize_is_refused() -> None:
    tier = Tier(100)
    tier.admit([1, 2, 4], [10, 10, 10])
    assert tier.prefix([1, 2, 3, 4]) == 2
    assert tier.prefix([1, 2, 3, 4], start=3) == 1
    assert tier.admit([5], [101]) == 0 and 5 not in tier and len(tier) == 3
    assert Tier(0).admit([1], [1]) == 0
