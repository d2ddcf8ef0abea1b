"""An open that fails half-way releases everything it took and raises its own error (``store.lifecycle``).

One test per point where ``PageStore.open`` / ``PageReader.open`` can stop: the writer lock, a segment
file, the new journal generation, building the shard, the fold of a replayed journal (a disk still full
after a close whose checkpoint failed), recovery. After each: no descriptor on the store's files, no
``kvtier-*`` thread, the writer lock free for another process, an injected engine closed, and an open
without the fault serving every page acknowledged before.
"""

from __future__ import annotations

import errno

import pytest
from support import (
    EngineWrapper,
    HostMemory,
    OSFaults,
    key,
    kvtier_threads,
    lock_free_elsewhere,
    namespace,
    open_fds_under,
    open_store,
    store_config,
)

from sgl_kvtier.errors import DeviceError, StoreLockedError
from sgl_kvtier.sharing import sites
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.store import devices, page_store
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store import journal_write as jw
from sgl_kvtier.store.layout import meta_dir
from sgl_kvtier.store.lifecycle import StoreCloseError
from sgl_kvtier.store.page_store import PageStore

BIG_PAGE = 256 * 1024 - 4096  # format 2: a 256 KiB slot with its trailer, four to a 1 MiB segment


class TrackedEngine(EngineWrapper):
    """Records whether the store closed it."""

    closed = False

    def close(self) -> None:
        super().close()
        self.closed = True


@pytest.fixture
def threads_before():
    return kvtier_threads()


def populate(path, pages: int = 16, page_bytes: int = BIG_PAGE) -> dict:
    """A shard holding ``pages`` acknowledged pages, closed cleanly; {key: bytes}."""
    mem = HostMemory(pages, page_bytes)
    expected = {key(i): mem.fill(i, 500 + i) for i in range(pages)}
    with open_store(path, page_bytes=page_bytes) as store:
        assert store.put(list(expected), [mem.runs(i) for i in range(pages)]) == [True] * pages
    return expected


def meta_of(path, page_bytes: int = BIG_PAGE):
    return meta_dir(store_config(path, page_bytes=page_bytes), namespace(page_bytes))


def assert_released(root, threads_before) -> None:
    assert open_fds_under(root) == {}, "descriptors of the store left open"
    assert kvtier_threads() - threads_before == set(), "kvtier threads left running"
    assert lock_free_elsewhere(meta_of(root)), "the writer lock is still held"


def assert_serves(path, expected: dict, page_bytes: int = BIG_PAGE):
    mem = HostMemory(max(1, len(expected)), page_bytes)
    with open_store(path, page_bytes=page_bytes) as store:
        assert sorted(store.keys()) == sorted(expected)
        assert store.get(list(expected), [mem.runs(i) for i in range(len(expected))]) == [True] * len(expected)
        assert [mem.page(i).tobytes() for i in range(len(expected))] == list(expected.values())
        return store.recovery


def open_writer(path, engine=None, page_bytes: int = BIG_PAGE, **config) -> PageStore:
    return sites.open_writer(store_config(path, page_bytes=page_bytes, **config), namespace(page_bytes), engine=engine)


def test_writer_lock_taken_closes_the_injected_engine(tmp_path, threads_before):
    with open_store(tmp_path, page_bytes=BIG_PAGE, sharing="off") as store:
        store.layout.settle()  # its first segment made (in the background): no descriptor comes or goes
        held = open_fds_under(tmp_path)
        engine = TrackedEngine()
        with pytest.raises(StoreLockedError):
            open_writer(tmp_path, engine, sharing="off")
        assert engine.closed and open_fds_under(tmp_path) == held  # the refused open left nothing behind
    assert_released(tmp_path, threads_before)


def test_missing_device_closes_the_injected_engine(tmp_path):
    engine = TrackedEngine()
    with pytest.raises(DeviceError):
        open_writer(tmp_path / "absent", engine)
    assert engine.closed


def test_a_segment_file_fails_to_open(tmp_path, threads_before, monkeypatch):
    expected = populate(tmp_path)
    assert len(list(meta_of(tmp_path).glob("w-*/seg-*.dat"))) == 5  # 4 in use, the next made ahead
    faults = OSFaults(errno.EIO, {"open"}, "seg-00002")
    engine = TrackedEngine()
    with monkeypatch.context() as m:
        m.setattr(devices, "os", faults)
        with pytest.raises(OSError) as info:
            open_writer(tmp_path, engine)
    assert info.value.errno == errno.EIO and faults.failed and engine.closed
    assert_released(tmp_path, threads_before)  # segments 0 and 1 were opened, then closed again
    assert_serves(tmp_path, expected)


def test_the_new_journal_generation_cannot_be_written(tmp_path, threads_before, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(jw, "os", OSFaults(errno.ENOSPC, {"write"}, "journal-"))
        with pytest.raises(OSError) as info:
            open_writer(tmp_path)
    assert info.value.errno == errno.ENOSPC and not isinstance(info.value, StoreCloseError)
    assert jr.journal_generations(meta_of(tmp_path)) == []  # the half-made journal was removed
    assert_released(tmp_path, threads_before)
    assert assert_serves(tmp_path, {}).problems == []


def test_building_the_shard_fails(tmp_path, threads_before, monkeypatch):
    expected = populate(tmp_path)

    def out_of_memory(threshold):
        raise MemoryError("no room for the admission filter")

    engine = TrackedEngine()
    with monkeypatch.context() as m:
        m.setattr(page_store, "AdmissionFilter", out_of_memory)
        with pytest.raises(MemoryError):
            open_writer(tmp_path, engine)
    assert engine.closed
    assert_released(tmp_path, threads_before)  # the new journal, the engine, the segments and the lock
    assert_serves(tmp_path, expected)


def test_the_fold_fails_on_a_disk_still_full(tmp_path, threads_before, monkeypatch):
    """The close's checkpoint failed (ENOSPC), and the disk is still full at the next open: its fold of
    the replayed journal fails too. Nothing is held after either; once there is room, nothing is lost."""
    expected = populate(tmp_path, pages=4)
    store = open_writer(tmp_path)
    mem = HostMemory(4, BIG_PAGE)
    more = {key(100 + i): mem.fill(i, 900 + i) for i in range(4)}
    assert store.put(list(more), [mem.runs(i) for i in range(4)]) == [True] * 4
    full = OSFaults(errno.ENOSPC, {"write"}, "checkpoint.bin")
    with monkeypatch.context() as m:
        m.setattr(devices, "os", full)
        with pytest.raises(StoreCloseError):
            store.close()
        assert_released(tmp_path, threads_before)
        engine = TrackedEngine()
        with pytest.raises(OSError) as info:
            open_writer(tmp_path, engine)
    assert info.value.errno == errno.ENOSPC and len(full.failed) == 2 and engine.closed
    assert_released(tmp_path, threads_before)
    recovery = assert_serves(tmp_path, {**expected, **more})
    assert recovery.replayed_records >= 4


def test_reader_recovery_fails(tmp_path, threads_before, monkeypatch):
    expected = populate(tmp_path)

    def unreadable(meta, *_):
        raise OSError(errno.EIO, "checkpoint unreadable", str(meta))

    engine = TrackedEngine()
    with monkeypatch.context() as m:
        m.setattr(jr, "recover", unreadable)
        with pytest.raises(OSError):
            PageReader.open(store_config(tmp_path, page_bytes=BIG_PAGE), namespace(BIG_PAGE), engine=engine)
    assert engine.closed
    assert_released(tmp_path, threads_before)
    assert_serves(tmp_path, expected)


def test_reader_of_no_store_closes_the_injected_engine(tmp_path, threads_before):
    engine = TrackedEngine()
    with pytest.raises(DeviceError, match="no store here"):
        PageReader.open(store_config(tmp_path), namespace(), engine=engine)
    assert engine.closed and open_fds_under(tmp_path) == {}
