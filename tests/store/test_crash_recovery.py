"""Kill a writing process with SIGKILL at random points; the reopened store must serve only exact bytes
and keep every page whose put was acknowledged under ``batch``/``always`` durability.

The writer checkpoints every few dozen records, so kills land in page writes, journal appends,
checkpoints and evictions alike. Each round reopens the store the previous round was killed on.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from crash_writer import page_bytes_for
from support import HostMemory, key, open_store

PAGE = 8192
CAPACITY = 96
HERE = Path(__file__).parent


def run_and_kill(path: Path, seed: int, durability: str, kill_after_acks: int) -> tuple[set[int], set[int]]:
    """Start a writer, SIGKILL it after ``kill_after_acks`` acks (+ a random extra delay in lines)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(HERE / "crash_writer.py"), str(path), str(seed), str(PAGE),
                             str(CAPACITY), durability], stdout=subprocess.PIPE, text=True, env=env)
    acked, deleted, acks = set(), set(), 0

    def take(line: str) -> None:
        parts = line.split()
        if parts and parts[0] == "ack":
            first, count, oks = int(parts[1]), int(parts[2]), parts[3]
            acked.update(first + j for j in range(count) if oks[j] == "1")
        elif parts and parts[0] == "del":
            deleted.add(int(parts[1]))

    try:
        assert proc.stdout.readline().strip() == "ready"
        for line in proc.stdout:
            take(line)
            acks += line.startswith("ack")
            if acks >= kill_after_acks:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        for line in proc.stdout:  # what it printed before the kill landed
            take(line)
        proc.wait()
    return acked - deleted, deleted


def verify(path: Path, must_have: set[int], durable: bool) -> tuple[int, int]:
    """Return (pages checked, pages lost); asserts no served page has wrong bytes."""
    mem = HostMemory(1, page_bytes=PAGE)
    checked = lost = 0
    with open_store(path, capacity_pages=CAPACITY, page_bytes=PAGE, eviction="lru") as store:
        for k in store.keys():
            n = int.from_bytes(k[:4], "little")
            if store.get([k], [mem.runs(0)]) == [True]:
                assert mem.page(0).tobytes() == page_bytes_for(n, PAGE), f"wrong bytes served for page {n}"
                checked += 1
        for n in must_have:
            if not store.contains(key(n)):
                lost += 1
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
        with open_store(tmp_path, capacity_pages=CAPACITY, page_bytes=PAGE, eviction="lru") as store:
            missing = [n for n in newest if not store.contains(key(n))]
        assert missing == [], f"round {round_no}: acknowledged pages lost after SIGKILL: {missing[:5]}"
    assert total_checked > 0


def test_durability_none_never_serves_wrong_bytes(tmp_path):
    rng = random.Random(7)
    for _ in range(6):
        run_and_kill(tmp_path, seed=rng.randrange(1 << 30), durability="none", kill_after_acks=rng.randrange(1, 20))
        verify(tmp_path, set(), durable=False)
