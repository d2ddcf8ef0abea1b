"""Rebuilding a writer's index from its pages alone (``admin.rebuild``, ``fsck --rebuild``): with the
journal and checkpoint gone every page comes back byte-exact with its chain; damage is only ever a miss;
the newest seq of a key wins; another namespace's slots are ignored; a live writer is never raced."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from support import HostMemory, key, namespace, open_store

from sgl_kvtier.admin.fsck import find_shards, rebuild_shard
from sgl_kvtier.errors import StoreFormatError
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.transfer import SlotIdentity

N = 24


def populate(root: Path, n: int = N, **cfg) -> tuple[list[bytes], Path]:
    """``n`` pages in chains of 6 (each chained on the page before); their bytes and the writer's meta."""
    mem = HostMemory(n)
    expected = [mem.fill(i, 1000 + i) for i in range(n)]
    with open_store(root, **cfg) as store:
        for c in range(0, n, 6):
            assert store.put([key(i) for i in range(c, c + 6)], [mem.runs(i) for i in range(c, c + 6)]) == [True] * 6
        return expected, store.layout.meta


def wipe_meta(meta: Path) -> None:
    for p in [meta / "checkpoint.bin", *meta.glob("journal-*.log")]:
        p.unlink()


def rebuild_all(root: Path):
    (shard,) = find_shards(str(root))
    outcomes = rebuild_shard(shard)
    assert [o.error for o in outcomes] == [None] * len(outcomes)
    return [o.report for o in outcomes]


def read_back(root: Path, n: int = N, **cfg) -> tuple[list[bool], list[bytes], list]:
    mem = HostMemory(n)
    with open_store(root, **cfg) as store:
        hits = store.get([key(i) for i in range(n)], [mem.runs(i) for i in range(n)])
        parents = [store.parent_of(key(i)) if store.contains(key(i)) else None for i in range(n)]
        return hits, [mem.page(i).tobytes() for i in range(n)], parents


def chain_parent(i: int):
    return None if i % 6 == 0 else key(i - 1)


@pytest.mark.parametrize("devices", [1, 2])
def test_rebuild_restores_every_page_and_chain(tmp_path, devices):
    cfg = {}
    if devices == 2:
        cfg["devices"] = [tmp_path / "d0", tmp_path / "d1"]
        for d in cfg["devices"]:
            d.mkdir()
        cfg["meta_dir"] = str(tmp_path / "d0")
    expected, meta = populate(tmp_path, **cfg)
    wipe_meta(meta)
    with pytest.raises(StoreFormatError, match="--rebuild"):  # a writer would overwrite pages it does not know
        open_store(tmp_path, **cfg)
    root = cfg["devices"][0] if devices == 2 else tmp_path
    (report,) = rebuild_all(root)
    assert report.pages == N and report.parents == N - N // 6 and report.torn == report.foreign == 0
    hits, got, parents = read_back(tmp_path, **cfg)
    assert hits == [True] * N and got == expected
    assert parents == [chain_parent(i) for i in range(N)]


def test_rebuild_on_a_raw_device(tmp_path):
    dev = tmp_path / "disk.img"
    with open(dev, "wb") as f:
        f.truncate(8 << 20)
    cfg = dict(devices=[str(dev)], meta_dir=str(tmp_path / "meta"), capacity_bytes=None)
    (tmp_path / "meta").mkdir()
    expected, meta = populate(tmp_path, **cfg)
    wipe_meta(meta)
    (report,) = rebuild_all(dev)
    assert report.pages == N
    hits, got, _ = read_back(tmp_path, **cfg)
    assert hits == [True] * N and got == expected


def test_damage_is_only_ever_a_miss(tmp_path):
    expected, meta = populate(tmp_path)
    slot_bytes = fmt.slot_bytes_for(len(expected[0]))
    page = len(expected[0])
    (seg,) = tmp_path.glob("ns-*/w-*/seg-*.dat")
    rng = random.Random(7)
    with open(seg, "r+b") as f:
        for slot in rng.sample(range(N - 4), 8):  # a flip in the page of four slots, in the trailer of four
            at = slot * slot_bytes + (rng.randrange(page) if slot % 2 else page + rng.randrange(fmt.trailer_bytes(1)))
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    os.truncate(seg, (N - 2) * slot_bytes + 100)  # the last two slots: one cut short, one gone
    wipe_meta(meta)
    (report,) = rebuild_all(tmp_path)
    assert report.torn >= 1 and report.bad_trailer + report.empty >= 1 and report.unreadable >= 1
    hits, got, _ = read_back(tmp_path)
    assert 0 < sum(hits) < N
    for i in range(N):
        assert got[i] == expected[i] if hits[i] else True  # a hit is always the right bytes
    assert report.pages == sum(hits)


def test_the_newest_seq_of_a_key_wins_and_other_namespaces_are_ignored(tmp_path):
    mem = HostMemory(4)
    mem.fill(0, 1)
    new = mem.fill(1, 2)
    mem.fill(2, 3)
    with open_store(tmp_path) as store:
        io = store._io
        # key 1: the newer copy in the lower slot; key 2: the newer copy in the higher slot.
        assert io.write([(mem.runs(1), 3, key(1), None, 50), (mem.runs(0), 4, key(1), None, 40),
                         (mem.runs(0), 5, key(2), None, 40), (mem.runs(1), 6, key(2), None, 50)]) != [None] * 4
        mine = io.identity
        io.identity = SlotIdentity(bytes(range(16)), mine.incarnation)  # another namespace's digest
        assert io.write([(mem.runs(2), 7, key(3), None, 60)])[0] is not None
        io.identity = mine
        meta = store.layout.meta
    wipe_meta(meta)
    (report,) = rebuild_all(tmp_path)
    assert report.pages == 2 and report.superseded == 2 and report.foreign == 1 and report.seq == 50
    mem.clear()
    with open_store(tmp_path) as store:
        assert store.slot_of(key(1)) == 3 and store.slot_of(key(2)) == 6 and store.slot_of(key(3)) is None
        assert store.get([key(1), key(2), key(3)], [mem.runs(i) for i in range(3)]) == [True, True, False]
        assert mem.page(0).tobytes() == new and mem.page(1).tobytes() == new
        # A page written after the rebuild sorts above every page found: its seq is higher.
        assert store.put([key(9)], [mem.runs(3)]) == [True]
        assert store._seq > 50


def test_a_live_writer_is_never_raced(tmp_path):
    expected, meta = populate(tmp_path)
    before = (meta / "checkpoint.bin").read_bytes()
    with open_store(tmp_path):  # holds the lock of the only writer directory with pages
        (shard,) = find_shards(str(tmp_path))
        (outcome,) = rebuild_shard(shard, wids=[meta.name[len("w-"):]])
        assert outcome.report is None and "open for writing" in (outcome.error or "")
        assert (meta / "checkpoint.bin").read_bytes() == before  # untouched by the refused rebuild
    hits, got, _ = read_back(tmp_path)
    assert hits == [True] * N and got == expected


def test_a_writer_with_only_pages_left_is_found_and_rebuilt(tmp_path):
    """The writer's whole meta directory is gone (LOCK, CONFIG, journal, checkpoint), only its segments on
    the device are left: rebuild finds the writer by them and the config by the namespace header."""
    dev, meta_root = tmp_path / "dev", tmp_path / "meta"
    dev.mkdir()
    meta_root.mkdir()
    cfg = dict(devices=[dev], meta_dir=str(meta_root), segment_bytes=2 << 20)
    expected, meta = populate(tmp_path, **cfg)
    for p in meta.iterdir():
        p.unlink()
    meta.rmdir()
    (report,) = rebuild_all(meta_root)
    assert report.pages == N and (meta / "CONFIG").exists() and (meta / "checkpoint.bin").exists()
    hits, got, _ = read_back(tmp_path, **cfg)
    assert hits == [True] * N and got == expected


def test_progress_counts_every_slot(tmp_path):
    populate(tmp_path)
    wipe_meta(next(tmp_path.glob("ns-*/w-*")))
    (shard,) = find_shards(str(tmp_path))
    seen: dict[str, list[int]] = {}

    def start(label: str, total: int):
        seen[label] = [total, 0]

        def step(n: int) -> None:
            seen[label][1] += n
        return step

    (outcome,) = rebuild_shard(shard, progress=start)
    ((total, done),) = seen.values()
    assert total == done == outcome.report.slots_scanned >= N
    assert namespace().model in next(iter(seen))
