"""Damage data and metadata on disk; a damaged page is a miss, never wrong bytes, and fsck finds it."""

from __future__ import annotations

import random

import numpy as np
import pytest
from support import HostMemory, key, open_store

from sgl_kvtier.admin.fsck import find_shards, fsck
from sgl_kvtier.errors import KVTierError
from sgl_kvtier.store.format import slot_bytes_for

PAGE = 16384
SLOT = slot_bytes_for(PAGE)  # format 2: a slot is the page, then its trailer, rounded to 4 KiB
N = 24


def populate(path, close=True):
    mem = HostMemory(N, page_bytes=PAGE)
    expected = {n: mem.fill(n, 1000 + n) for n in range(N)}
    store = open_store(path, page_bytes=PAGE)
    assert all(store.put([key(n) for n in range(N)], [mem.runs(n) for n in range(N)]))
    slots = {n: store.slot_of(key(n)) for n in range(N)}
    if close:
        store.close()
    return expected, slots, store


def served(path) -> dict[int, bytes]:
    mem = HostMemory(1, page_bytes=PAGE)
    out = {}
    with open_store(path, page_bytes=PAGE) as store:
        for n in range(N):
            if store.get([key(n)], [mem.runs(0)]) == [True]:
                out[n] = mem.page(0).tobytes()
    return out


def segment(path):
    (seg,) = list(path.glob("ns-*/w-*/seg-*.dat"))
    return seg


def test_bit_flips_in_data_are_misses_and_fsck_reports_them(tmp_path):
    expected, slots, _ = populate(tmp_path)
    rng = random.Random(5)
    victims = rng.sample(range(N), 6)
    with open(segment(tmp_path), "r+b") as f:
        for n in victims:
            pos = slots[n] * SLOT + rng.randrange(PAGE)
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    (shard,) = find_shards(str(tmp_path))
    report = fsck(shard)
    assert sorted(report.bad_pages) == sorted(key(n).hex() for n in victims)
    assert fsck(shard, repair=True).repaired
    assert fsck(shard).clean
    got = served(tmp_path)
    assert set(got) == set(range(N)) - set(victims)
    assert all(got[n] == expected[n] for n in got)


def test_zeroed_blocks_and_truncated_segment(tmp_path):
    expected, slots, _ = populate(tmp_path)
    seg = segment(tmp_path)
    with open(seg, "r+b") as f:
        f.seek(slots[3] * SLOT + 4096)
        f.write(b"\0" * 4096)
    last = max(slots, key=slots.get)
    with open(seg, "r+b") as f:
        f.truncate(slots[last] * SLOT + PAGE // 2)  # the last page is torn in half
    got = served(tmp_path)
    assert 3 not in got and last not in got
    assert all(got[n] == expected[n] for n in got)
    assert len(got) == N - 2


def test_torn_and_corrupt_journal(tmp_path):
    _, _, store = populate(tmp_path, close=False)  # the pages live only in the journal: no checkpoint yet
    journal = store._journal.path
    store._journal.sync()
    store._close_lease()  # the process dies: its lease thread gone, its lock released by the kernel
    store.claim.release()
    data = bytearray(journal.read_bytes())
    cut = len(data) * 2 // 3
    data[cut] ^= 0xFF  # corrupt one record in the middle; replay must stop there
    journal.write_bytes(bytes(data))
    (shard,) = find_shards(str(tmp_path))
    report = fsck(shard)
    assert report.problems and "torn or corrupt" in report.problems[0]
    got = served(tmp_path)
    assert 0 < len(got) < N
    assert sorted(got) == list(range(len(got)))  # the readable prefix of the journal, in order
    assert fsck(shard).clean  # the writer open folded the journal and dropped the damaged tail


def test_corrupt_checkpoint_falls_back_to_journals_or_misses(tmp_path):
    expected, _, _ = populate(tmp_path)
    (ckpt,) = list(tmp_path.glob("ns-*/w-*/checkpoint.bin"))
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0x55
    ckpt.write_bytes(bytes(data))
    (shard,) = find_shards(str(tmp_path))
    assert any("checkpoint" in p for p in fsck(shard).problems)
    got = served(tmp_path)  # the journals the checkpoint covered are gone: pages are lost, not wrong
    assert all(got[n] == expected[n] for n in got)
    assert fsck(shard).clean


@pytest.mark.parametrize("seed", range(3))
def test_random_faults_never_serve_wrong_bytes(tmp_path, seed):
    """Many random faults anywhere in the shard's files (data and metadata)."""
    rng = np.random.default_rng(seed)
    expected, _, _ = populate(tmp_path)
    files = [p for p in tmp_path.glob("ns-*/w-*/*") if p.name not in ("LOCK",)]
    for _ in range(40):
        target = files[rng.integers(len(files))]
        data = bytearray(target.read_bytes())
        if not data:
            continue
        kind = rng.integers(3)
        if kind == 0:
            data[rng.integers(len(data))] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            start = int(rng.integers(len(data))) // 4096 * 4096
            data[start:start + 4096] = b"\0" * len(data[start:start + 4096])
        else:
            data = data[:int(rng.integers(len(data)))]
        target.write_bytes(bytes(data))
    try:
        got = served(tmp_path)
    except KVTierError as exc:  # a destroyed HEADER is refused at open with a clear error
        assert "header" in str(exc).lower()
        return
    assert all(got[n] == expected[n] for n in got)
