"""PageReader: a read-only view that follows its shard's live writer, never writes, and coexists with others."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from support import EngineWrapper, HostMemory, key, namespace, open_store, store_config

from sgl_kvtier.errors import DeviceError
from sgl_kvtier.io.engine import IOOp, IOResult, OpKind
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.store.page_store import PageStore


def put_range(store: PageStore, mem: HostMemory, first: int, count: int, slot0: int = 0) -> dict[bytes, bytes]:
    expected = {key(first + j): mem.fill(slot0 + j, first + j) for j in range(count)}
    assert store.put(list(expected), [mem.runs(slot0 + j) for j in range(count)]) == [True] * count
    return expected


def checkpoint_past_the_journals(writer: PageStore, mem: HostMemory) -> None:
    """Pages ``key(10..39)``: enough records (checkpoint_interval=10) that the writer checkpoints and
    deletes the journals a reader was following."""
    for base in range(10, 40, 6):
        put_range(writer, mem, base, 6, slot0=6)


def open_reader(path: Path, **config) -> PageReader:
    return PageReader.open(store_config(path, **config), namespace())


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` with a digest of its bytes."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


class HookedEngine(EngineWrapper):
    """Runs ``hook`` once, at the start of the first read batch, before the reads are issued."""

    def __init__(self, hook: Callable[[], None]):
        super().__init__()
        self.hook: Callable[[], None] | None = hook

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        if ops and ops[0].kind is OpKind.READ and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return self.inner.run(ops)


def test_reader_serves_pages_and_has_no_write_api(tmp_path):
    mem = HostMemory(2)
    with open_store(tmp_path) as store:
        expected = put_range(store, mem, 0, 2)
    with open_reader(tmp_path) as reader:
        assert reader.longest_prefix([key(0), key(1)]) == 2
        mem.clear()
        assert reader.get([key(1), key(0)], [mem.runs(0), mem.runs(1)]) == [True, True]
        assert mem.page(0).tobytes() == expected[key(1)] and mem.page(1).tobytes() == expected[key(0)]
        for write in ("put", "delete", "clear", "checkpoint"):
            assert not hasattr(reader, write)


def test_reader_needs_an_existing_shard_and_creates_nothing(tmp_path):
    with pytest.raises(DeviceError, match="no store here"):
        open_reader(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_reader_follows_a_live_writer(tmp_path):
    """MLA: one writer rank, every rank reads; a reader sees new pages, deletions and checkpoints."""
    mem = HostMemory(16)
    # The writer holds the shard's lock the whole time: a reader needs none.
    with open_store(tmp_path, checkpoint_interval=10) as writer, \
            open_reader(tmp_path, checkpoint_interval=10) as reader:
        assert reader.longest_prefix([key(0)]) == 0 and reader.refresh() is False
        expected = put_range(writer, mem, 0, 4)
        assert reader.refresh() is True and reader.longest_prefix([key(i) for i in range(4)]) == 4
        writer.delete([key(1)])
        reader.refresh()
        assert reader.longest_prefix([key(i) for i in range(4)]) == 1
        checkpoint_past_the_journals(writer, mem)
        reader.refresh()
        assert reader.longest_prefix([key(i) for i in range(10, 40)]) == 30
        mem.clear()
        assert reader.get([key(0), key(2)], [mem.runs(0), mem.runs(1)]) == [True, True]
        assert mem.page(0).tobytes() == expected[key(0)] and mem.page(1).tobytes() == expected[key(2)]


def test_several_readers_follow_one_writer_each_at_its_own_pace(tmp_path):
    mem = HostMemory(8)
    with open_store(tmp_path) as writer:
        put_range(writer, mem, 0, 2)
        with open_reader(tmp_path) as early, open_reader(tmp_path) as late:
            put_range(writer, mem, 2, 2, slot0=2)
            assert early.refresh() is True
            assert early.longest_prefix([key(i) for i in range(4)]) == 4
            assert late.longest_prefix([key(i) for i in range(4)]) == 2  # not refreshed yet: its own view
            with open_reader(tmp_path) as third:  # opened now: sees everything at once
                assert third.longest_prefix([key(i) for i in range(4)]) == 4
            assert late.refresh() is True and late.longest_prefix([key(i) for i in range(4)]) == 4


def test_reader_never_writes_a_file_even_when_it_drops_a_corrupt_page(tmp_path):
    mem = HostMemory(4)
    with open_store(tmp_path) as store:
        put_range(store, mem, 0, 4)
        slot = store.slot_of(key(2))
    (seg,) = tmp_path.glob("ns-*/w-*/seg-*.dat")
    with open(seg, "r+b") as f:
        f.seek(slot * store.slot_bytes + 100)
        f.write(b"\xff" * 8)
    before = tree(tmp_path)
    with open_reader(tmp_path) as reader:
        assert reader.get([key(i) for i in range(4)], [mem.runs(i) for i in range(4)]) == [True, True, False, True]
        assert reader.counters.corrupt_pages == 1 and not reader.contains(key(2))  # dropped from its view
        reader.refresh()
    assert tree(tmp_path) == before
    with open_store(tmp_path) as store:  # the shard is the writer's: it still lists the page until it reads it
        assert store.contains(key(2))
        assert store.get([key(2)], [mem.runs(0)]) == [False] and not store.contains(key(2))


def test_a_read_in_flight_survives_a_refresh_that_rebuilds_the_index(tmp_path):
    """The writer checkpoints past the reader's journal while a read is pinned: the reader rebuilds its
    index and slot table, and the read in flight still lands and unpins."""
    mem = HostMemory(16)
    writer = open_store(tmp_path, checkpoint_interval=10)
    expected = put_range(writer, mem, 0, 2)
    reader: PageReader | None = None

    def checkpoint_and_refresh() -> None:
        checkpoint_past_the_journals(writer, mem)
        assert reader is not None and reader.refresh() is True
        assert reader.longest_prefix([key(i) for i in range(10, 40)]) == 30  # rebuilt from the new checkpoint

    reader = PageReader.open(store_config(tmp_path, checkpoint_interval=10), namespace(),
                             engine=HookedEngine(checkpoint_and_refresh))
    try:
        out = HostMemory(2)
        assert reader.get([key(0), key(1)], [out.runs(0), out.runs(1)]) == [True, True]
        assert [out.page(i).tobytes() for i in range(2)] == [expected[key(0)], expected[key(1)]]
    finally:
        reader.close()
        writer.close()
