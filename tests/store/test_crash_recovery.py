"""Kill a writing process with SIGKILL at random points; the reopened store must serve only exact bytes
and keep every page whose put was acknowledged under ``batch``/``always`` durability.

The writer checkpoints every few dozen records, so kills land in page writes, journal appends,
checkpoints and evictions alike. Each round reopens the store the previous round was killed on.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.store.crash import CAPACITY, check_store, key, open_small, run_and_kill


def verify(path, must_have: set[int], durable: bool) -> tuple[int, int]:
    """Return (pages checked, pages lost); asserts no served page has wrong bytes."""
    checked, wrong, lost = check_store(path, sorted(must_have))
    assert wrong == 0, f"{wrong} pages served with wrong bytes"
    return checked, lost


@pytest.mark.parametrize("durability", ["batch", "always"])
def test_sigkill_at_random_points(tmp_path, durability):
    rng = random.Random(1234 if durability == "batch" else 99)
    total_checked = 0
    for round_no in range(12):
        acked, _ = run_and_kill(tmp_path, seed=rng.randrange(1 << 30), durability=durability,
                                kill_after_acks=rng.randrange(1, 30))
        checked, _ = verify(tmp_path, set(), durable=True)
        total_checked += checked
        # Pages acknowledged in this round and not evicted since must all be there: the writer put at
        # most CAPACITY pages after the oldest ones, so only the newest CAPACITY // 2 acks are safe from eviction.
        newest = sorted(acked)[-(CAPACITY // 2):]
        with open_small(tmp_path, eviction="lru") as store:
            missing = [n for n in newest if not store.contains(key(n))]
        assert missing == [], f"round {round_no}: acknowledged pages lost after SIGKILL: {missing[:5]}"
    assert total_checked > 0


def test_durability_none_never_serves_wrong_bytes(tmp_path):
    rng = random.Random(7)
    for _ in range(6):
        run_and_kill(tmp_path, seed=rng.randrange(1 << 30), durability="none", kill_after_acks=rng.randrange(1, 20))
        verify(tmp_path, set(), durable=False)
