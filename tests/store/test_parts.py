"""Pages of several checksummed parts (``store.parts``) and group-major reads (``store.part_reads``): a
checksum per part written and kept everywhere (header, journal, index, checkpoint, trailer, rebuild), every
part verified on every read, and ``get_parts`` reading group 0 of every page, then group 1, ..."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from support import EngineWrapper, HostMemory, flip, key, namespace, store_config

from sgl_kvtier.admin.fsck import find_shards, fsck, rebuild_shard
from sgl_kvtier.errors import StoreFormatError
from sgl_kvtier.io.engine import IOOp, IOResult
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store import journal_write as jw
from sgl_kvtier.store.parts import PartMap, pack_sums, sums_list

PAGE = 16384
PARTS = (4096, 4096, 4096, 4096)
ODD_PARTS = (3000, 5192, 4096, 4096)  # the first two not 4 KiB aligned: bounced under O_DIRECT
N = 8


def config(root: Path, parts: Sequence[int] = PARTS, **extra):
    extra.setdefault("capacity_bytes", 64 * fmt.slot_bytes_for(PAGE, len(parts)))
    return store_config(root, page_bytes=PAGE, **extra)


def ns(parts: Sequence[int] = PARTS, **extra):
    return namespace(PAGE, parts=tuple(parts), **extra)


def fill(n: int = N) -> tuple[HostMemory, list[bytes]]:
    mem = HostMemory(n, PAGE)
    return mem, [mem.fill(i, 100 + i) for i in range(n)]


def keys(n: int = N):
    return [key(i) for i in range(n)]


def runs(mem: HostMemory, n: int = N):
    return [mem.runs(i) for i in range(n)]


class Recording(EngineWrapper):
    """Records each batch's ops (offset within the slot, length); ``on_batch`` runs before a batch's IO."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[tuple[int, int]]] = []
        self.on_batch = lambda ops: None

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        self.on_batch(ops)
        self.batches.append([(op.offset, sum(b.nbytes for b in op.buffers)) for op in ops])
        return self.inner.run(ops)


# ---------------------------------------------------------------------------------------------- helpers
def test_part_map_cuts_runs_at_part_boundaries_and_checks_groups():
    pm = PartMap.of([3, 5, 8])
    assert pm.offsets == (0, 3, 8) and pm.page_bytes == 16
    assert pm.split([(100, 4), (200, 12)]) == [[(100, 3)], [(103, 1), (200, 4)], [(204, 8)]]
    # Another page of the same shape reuses the cuts at its own addresses; other shapes cut their own way.
    assert pm.split([(900, 4), (50, 12)]) == [[(900, 3)], [(903, 1), (50, 4)], [(54, 8)]]
    assert pm.split([(0, 2), (10, 0), (20, 14)]) == [[(0, 2), (20, 1)], [(21, 5)], [(26, 8)]]
    assert pm.split([(0, 10)]) == [[(0, 3)], [(3, 5)], [(8, 2)]]  # fewer bytes: the last part short
    with pytest.raises(ValueError, match="more than"):
        pm.split([(0, 17)])
    with pytest.raises(ValueError, match="more than"):  # not remembered as a good shape
        pm.split([(0, 17)])
    assert pm.plan() == [(0,), (1,), (2,)] and pm.plan([[2, 0], [1]]) == [(2, 0), (1,)]
    for bad in ([[0, 1]], [[0, 1], [1, 2]], [[0, 1, 2], []], [[0, 1, 3]]):
        with pytest.raises(ValueError, match="exactly once"):
            pm.plan(bad)
    assert sums_list(pack_sums([1, 2, 2**64 - 1])) == [1, 2, 2**64 - 1] and pack_sums([7]) == 7


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("parts, mem_offset, direct", [
    (PARTS, 0, "auto"), (ODD_PARTS, 0, "auto"), (PARTS, 512, "auto"), (ODD_PARTS, 0, "off")])
def test_multi_part_pages_round_trip_get_and_get_parts(tmp_path, parts, mem_offset, direct):
    mem = HostMemory(N, PAGE, runs_per_page=4 if mem_offset else 2, offset=mem_offset)
    expected = [mem.fill(i, 7 + i) for i in range(N)]
    with open_writer(config(tmp_path, parts, direct_io=direct), ns(parts)) as store:
        assert store.layout.direct == (direct == "auto")
        assert store.put(keys(), runs(mem)) == [True] * N
        entry = store._index.lookup(key(0))
        assert entry is not None and isinstance(entry[1], bytes) and len(entry[1]) == 8 * len(parts)
        mem.clear()
        assert store.get(keys(), runs(mem)) == [True] * N
        assert [mem.page(i).tobytes() for i in range(N)] == expected
        mem.clear()
        seen: list[tuple[int, list[bool]]] = []
        assert store.get_parts(keys(), runs(mem), lambda g, ok: seen.append((g, ok))) == [True] * N
        assert seen == [(g, [True] * N) for g in range(len(parts))]
        assert [mem.page(i).tobytes() for i in range(N)] == expected
        assert store.counters.parts_read == N * len(parts) and store.counters.parts_failed == 0


def test_a_raw_device_keeps_parts_and_rebuilds_from_them(tmp_path):
    dev = tmp_path / "disk.img"
    with open(dev, "wb") as f:
        f.truncate(8 << 20)
    (tmp_path / "meta").mkdir()
    cfg = config(tmp_path, devices=[str(dev)], meta_dir=str(tmp_path / "meta"), capacity_bytes=None)
    mem, expected = fill()
    with open_writer(cfg, ns()) as store:
        assert store.put(keys(), runs(mem)) == [True] * N
        mem.clear()
        assert store.get(keys(), runs(mem)) == [True] * N
        assert [mem.page(i).tobytes() for i in range(N)] == expected
        meta = store.layout.meta
    for p in [meta / "checkpoint.bin", *meta.glob("journal-*.log")]:
        p.unlink()
    (shard,) = find_shards(str(dev))
    assert shard.header["parts"] == list(PARTS)
    (outcome,) = rebuild_shard(shard)
    assert outcome.error is None and outcome.report is not None and outcome.report.pages == N
    mem.clear()
    with open_writer(cfg, ns()) as store:
        assert store.get_parts(keys(), runs(mem), lambda g, ok: None) == [True] * N
        assert [mem.page(i).tobytes() for i in range(N)] == expected


def test_recovery_from_journal_and_checkpoint_keeps_every_parts_checksum(tmp_path):
    cfg, mem = config(tmp_path), fill()[0]
    with open_writer(cfg, ns()) as store:
        assert store.put(keys(), runs(mem)) == [True] * N
        written = {k: store._index.lookup(k) for k in keys()}
        meta = store.layout.meta
        from_journal = jr.recover(meta, len(PARTS))  # no checkpoint yet: the PUT records
        assert not (meta / "checkpoint.bin").exists() and from_journal.problems == []
        assert {k: (s, from_journal.checksum[s]) for k, s in from_journal.slot_of.items()} == written
        with PageReader.open(cfg, ns()) as reader:  # a follower of the live writer, from its journal
            assert reader.get_parts(keys(), runs(mem), lambda g, ok: None) == [True] * N
    from_checkpoint = jr.recover(meta, len(PARTS))
    assert from_checkpoint.replayed_records == 0
    assert {k: (s, from_checkpoint.checksum[s]) for k, s in from_checkpoint.slot_of.items()} == written
    assert "checkpoint unreadable" in jr.recover(meta, 2).problems[0]  # another count: not misread
    seg = next(meta.parent.parent.glob("ns-*/w-*/seg-*.dat"))
    slot_bytes = fmt.slot_bytes_for(PAGE, len(PARTS))
    with open(seg, "rb") as f:  # every slot's trailer carries the same checksums
        data = f.read()
    for slot, sums in from_checkpoint.checksum.items():
        trailer = fmt.unpack_trailer(data[slot * slot_bytes + PAGE:(slot + 1) * slot_bytes])
        assert trailer is not None and list(trailer.checksums) == sums_list(sums)


def test_a_put_record_with_another_number_of_checksums_indexes_nothing(tmp_path):
    a, b = key(1), key(2)
    j = jw.Journal(tmp_path, 1)
    j.append([jw.put_record(1, a, 0, pack_sums([1, 2, 3, 4]), None), jw.put_record(2, b, 1, 5, None)])
    j.close()
    state = jr.recover(tmp_path, 4)
    assert list(state.slot_of) == [a] and state.checksum[0] == pack_sums([1, 2, 3, 4])
    assert len(state.problems) == 1 and "has 1 checksums" in state.problems[0]


def test_rebuild_takes_the_headers_parts(tmp_path):
    mem, expected = fill()
    with open_writer(config(tmp_path), ns()) as store:
        assert store.put(keys(), runs(mem)) == [True] * N
        meta = store.layout.meta
    for p in [meta / "checkpoint.bin", *meta.glob("journal-*.log")]:
        p.unlink()
    (shard,) = find_shards(str(tmp_path))
    (outcome,) = rebuild_shard(shard)
    assert outcome.report is not None and (outcome.report.pages, outcome.report.torn) == (N, 0)
    mem.clear()
    with open_writer(config(tmp_path), ns()) as store:
        assert store.get(keys(), runs(mem)) == [True] * N
        assert [mem.page(i).tobytes() for i in range(N)] == expected
    assert fsck(shard).clean


# ---------------------------------------------------------------------------------------- verification
@pytest.mark.parametrize("parts", [PARTS, ODD_PARTS])
def test_a_bad_byte_in_part_1_fails_that_page_from_part_1_on(tmp_path, parts):
    mem = fill()[0]
    engine = Recording()
    with open_writer(config(tmp_path, parts), ns(parts), engine=engine) as store:
        assert store.put(keys(), runs(mem)) == [True] * N
        flip(store, key(3), PartMap.of(parts).offsets[1] + 17)
        seen: list[tuple[int, list[bool]]] = []
        engine.batches.clear()
        assert store.get_parts(keys(), runs(mem), lambda g, ok: seen.append((g, ok))) == \
            [i != 3 for i in range(N)]
        assert [ok[3] for _, ok in seen] == [True, False, False, False]
        assert all(ok[i] for _, ok in seen for i in range(N) if i != 3)
        # Group 2 was sent beside group 1, before its verdicts: page 3 is in it; group 3 is sent without it
        # (two groups are in flight together, so their batches may reach the engine in either order).
        assert sorted(len(b) for b in engine.batches) == [N - 1, N, N, N]
        assert (store.counters.parts_read, store.counters.parts_failed) == (len(parts) * N - 2, 1)
        assert store.counters.corrupt_pages == 1 and not store.contains(key(3))  # dropped, as ``get`` does


def test_get_verifies_every_part(tmp_path):
    mem = fill()[0]
    with open_writer(config(tmp_path), ns()) as store:
        assert store.put(keys(), runs(mem)) == [True] * N
        flip(store, key(5), 3 * 4096 + 1)  # the last part only
        assert store.get(keys(), runs(mem)) == [i != 5 for i in range(N)]
        (shard,) = find_shards(str(tmp_path))
    assert fsck(shard).clean  # the bad page was dropped (journaled) by the read above


def test_groups_are_read_group_major_with_the_next_in_flight_during_on_part(tmp_path):
    mem, expected = fill()
    engine = Recording()
    with open_writer(config(tmp_path), ns(), engine=engine) as store:
        assert store.put(keys(), runs(mem)) == [True] * N
        slot_offset = {store._io.locate(store.slot_of(k))[1]: k for k in keys()}
        mem.clear()
        engine.batches.clear()
        second = threading.Event()
        engine.on_batch = lambda ops: second.set() if len(engine.batches) == 1 else None
        calls: list[int] = []

        def on_part(g: int, ok: list[bool]) -> None:
            calls.append(g)
            if g == 0:  # group 1's IO is sent while the caller works on group 0
                assert second.wait(10)
            assert ok == [True] * N

        assert store.get_parts(keys(), runs(mem), on_part, groups=[[0, 2], [1, 3]]) == [True] * N
        assert calls == [0, 1] and len(engine.batches) == 2
        within = sorted(sorted({off - max(o for o in slot_offset if o <= off) for off, _ in b}) for b in engine.batches)
        assert within == [[p * 4096 for p in parts] for parts in ((0, 2), (1, 3))]  # in flight together: any order
        assert all({n for _, n in b} == {4096} for b in engine.batches)
        assert [mem.page(i).tobytes() for i in range(N)] == expected
        with pytest.raises(ValueError, match="exactly once"):
            store.get_parts(keys(), runs(mem), on_part, groups=[[0, 1]])
        assert not store._slots._pins


def test_consecutive_parts_of_a_group_are_one_io_each_part_verified(tmp_path):
    """Groups [0, 1] and [2, 3]: one op per page per group (the two parts adjacent in the slot), its bytes
    exact, every part counted; a bad byte in part 1 fails its page at group 0, the op's part 0 verified (and
    group 1, sent beside group 0 before its verdicts, still reads the page: its parts verify, it stays failed)."""
    mem, expected = fill()
    engine = Recording()
    with open_writer(config(tmp_path), ns(), engine=engine) as store:
        assert store.put(keys(), runs(mem)) == [True] * N
        base = {k: store._io.locate(store.slot_of(k))[1] for k in keys()}
        mem.clear()
        engine.batches.clear()
        assert store.get_parts(keys(), runs(mem), lambda g, ok: None, groups=[[0, 1], [2, 3]]) == [True] * N
        assert sorted(sorted(b) for b in engine.batches) == [sorted((base[k] + at, 8192) for k in keys())
                                                             for at in (0, 8192)]
        assert [mem.page(i).tobytes() for i in range(N)] == expected
        assert (store.counters.parts_read, store.counters.parts_failed) == (4 * N, 0)
        flip(store, key(3), 4096 + 17)  # part 1
        mem.clear()
        engine.batches.clear()
        seen: list[list[bool]] = []
        assert store.get_parts(keys(), runs(mem), lambda g, ok: seen.append(ok), groups=[[0, 1], [2, 3]]) == \
            [i != 3 for i in range(N)]
        assert [ok[3] for ok in seen] == [False, False] and [len(b) for b in engine.batches] == [N, N]
        assert (store.counters.parts_read, store.counters.parts_failed) == (4 * N + 4 * (N - 1) + 3, 1)
        assert store.counters.corrupt_pages == 1 and not store.contains(key(3))


def test_a_part_needing_a_bounce_buffer_is_an_io_of_its_own(tmp_path):
    """ODD_PARTS under O_DIRECT: parts 0 and 1 are unaligned (bounced, one op each), 2 and 3 aligned (one op)."""
    mem, expected = fill()
    engine = Recording()
    with open_writer(config(tmp_path, ODD_PARTS), ns(ODD_PARTS), engine=engine) as store:
        assert store.layout.direct
        assert store.put(keys(), runs(mem)) == [True] * N
        mem.clear()
        engine.batches.clear()
        assert store.get_parts(keys(), runs(mem), lambda g, ok: None, groups=[[0, 1], [2, 3]]) == [True] * N
        base = {store._io.locate(store.slot_of(k))[1] for k in keys()}
        ops = [op for batch in engine.batches for op in batch]  # (the bounced ones may take several batches)
        assert len(ops) == 3 * N and sorted(op for op in ops if op[0] - 8192 in base) == sorted(
            (b + 8192, 8192) for b in base)  # parts 2 and 3: one op per page
        assert [mem.page(i).tobytes() for i in range(N)] == expected
        assert (store.counters.parts_read, store.counters.parts_failed) == (4 * N, 0)


def test_an_on_part_error_leaks_no_pin_nor_buffer(tmp_path):
    mem = HostMemory(N, PAGE, offset=512)  # unaligned: every part through a bounce buffer
    expected = [mem.fill(i, i) for i in range(N)]
    with open_writer(config(tmp_path), ns()) as store:
        assert store.put(keys(), runs(mem)) == [True] * N

        def boom(g: int, ok: list[bool]) -> None:
            if g == 1:
                raise RuntimeError("caller failed")

        with pytest.raises(RuntimeError, match="caller failed"):
            store.get_parts(keys(), runs(mem), boom)
        assert not store._slots._pins
        pool = store._io.bounces
        assert len(pool._free) == len(pool._all)
        assert store.counters.corrupt_pages == 0 and len(store) == N  # left early: misses, pages kept
        mem.clear()
        assert store.get_parts(keys(), runs(mem), lambda g, ok: None) == [True] * N
        assert [mem.page(i).tobytes() for i in range(N)] == expected


def test_a_slot_being_read_group_major_is_never_reused(tmp_path):
    mem, expected = fill()
    other = HostMemory(N, PAGE)
    for i in range(N):
        other.fill(i, 900 + i)
    cfg = config(tmp_path, capacity_bytes=N * fmt.slot_bytes_for(PAGE, len(PARTS)))  # room for N pages only
    with open_writer(cfg, ns()) as store:
        assert store.put(keys(), runs(mem)) == [True] * N
        mem.clear()
        stored: list[list[bool]] = []

        def on_part(g: int, ok: list[bool]) -> None:
            if g == 0:  # evicting every page being read frees no slot while the read holds them
                stored.append(store.put([key(100 + i) for i in range(N)], runs(other)))

        assert store.get_parts(keys(), runs(mem), on_part) == [True] * N
        assert stored == [[False] * N] and store.counters.put_no_space == N
        assert [mem.page(i).tobytes() for i in range(N)] == expected
        assert store.put([key(100 + i) for i in range(N)], runs(other)) == [True] * N  # unpinned: reused now


def test_a_one_part_store_reads_group_major_as_one_group(tmp_path):
    mem = HostMemory(4)
    expected = [mem.fill(i, i) for i in range(4)]
    with open_writer(store_config(tmp_path), namespace()) as store:
        assert store.put(keys(4), runs(mem, 4)) == [True] * 4
        entry = store._index.lookup(key(0))
        assert entry is not None and isinstance(entry[1], int)
        mem.clear()
        seen: list[int] = []
        assert store.get_parts([*keys(4), key(99)], [*runs(mem, 4), mem.runs(0)],
                               lambda g, ok: seen.append(g)) == [True] * 4 + [False]
        assert seen == [0] and [mem.page(i).tobytes() for i in range(4)] == expected


# ------------------------------------------------------------------------------------------- the pool
def test_pool_get_parts_routes_across_two_writers(tmp_path):
    cfg, mem, expected = config(tmp_path), *fill()
    with SharedPool.open_writer(cfg, ns()) as a, SharedPool.open_writer(cfg, ns()) as b:
        assert a.put(keys()[:4], runs(mem)[:4]) == [True] * 4
        assert b.put(keys()[4:], runs(mem)[4:]) == [True] * 4
        a.refresh(force=True)
        assert {a._holder(k) for k in keys()} == {a.own, a.peers()[b.wid]}
        mem.clear()
        seen: list[tuple[int, list[bool]]] = []
        got = a.get_parts([*keys(), key(99)], [*runs(mem), mem.runs(0)], lambda g, ok: seen.append((g, ok)))
        assert got == [True] * N + [False]
        assert seen == [(g, [True] * N + [False]) for g in range(len(PARTS))]
        assert [mem.page(i).tobytes() for i in range(N)] == expected
        assert a.counters.parts_read == N * len(PARTS)
        assert set(a.own._touched) == set(keys()[4:])  # the peer's pages: journaled as uses


def test_a_peer_dropped_during_a_group_major_read_is_closed_only_after_it(tmp_path):
    """The pool drops a followed writer (``Peers._drop``: retired from use) while a group-major read of its pages
    is between groups: the read finishes every group from it, and the peer is closed once the read ends."""
    cfg, mem, expected = config(tmp_path), *fill()
    with SharedPool.open_writer(cfg, ns()) as a, SharedPool.open_writer(cfg, ns()) as b:
        assert b.put(keys(), runs(mem)) == [True] * N
        a.refresh(force=True)
        peer = a.peers()[b.wid]
        mem.clear()
        seen: list[tuple[int, list[bool]]] = []

        def on_part(group: int, ok: list[bool]) -> None:
            seen.append((group, list(ok)))
            if group == 0:
                a._in_use.retire(peer)  # what a refresh that drops the peer does, on another thread
                assert not peer._closed  # still in use by this read

        assert a.get_parts(keys(), runs(mem), on_part) == [True] * N
        assert seen == [(g, [True] * N) for g in range(len(PARTS))]
        assert [mem.page(i).tobytes() for i in range(N)] == expected
        assert peer._closed  # closed by the read's end


# ------------------------------------------------------------------------------------------ identity
def test_parts_name_another_shard_and_a_mismatched_header_is_refused(tmp_path):
    assert ns().digest() != ns(ODD_PARTS).digest() != namespace(PAGE).digest()
    assert namespace(PAGE, parts=(PAGE,)) == namespace(PAGE)  # one part: the whole page
    with open_writer(config(tmp_path), ns()) as store:
        assert store.slot_bytes == fmt.slot_bytes_for(PAGE, len(PARTS))
    header_path = tmp_path / ns().dirname() / "HEADER"
    header = fmt.unpack_header(fmt.HEADER_MAGIC, header_path.read_bytes(), "h")
    assert header["parts"] == list(PARTS) and header["namespace"]["parts"] == list(PARTS)
    header["parts"] = [PAGE // 2, PAGE // 2]
    header_path.write_bytes(fmt.pack_header(fmt.HEADER_MAGIC, header))
    with pytest.raises(StoreFormatError, match="parts is"):
        open_writer(config(tmp_path), ns())
