"""Closing a shard releases everything on every path (``store.lifecycle``), one test per failure point.

After each close, failed or not: no descriptor on the store's files is left in this process, no
``kvtier-*`` thread is left, another process can take the writer lock, and a re-open in this process
serves every page acknowledged before (from the journal where the close's checkpoint failed).
"""

from __future__ import annotations

import errno
import shutil

import pytest
from support import (
    PAGE_BYTES,
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

from sgl_kvtier.errors import StoreClosedError
from sgl_kvtier.sharing import writers
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.store import devices
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store import journal_write as jw
from sgl_kvtier.store.lifecycle import Acquired, StoreCloseError, close_all, release_all, run_steps

BIG_PAGE = 256 * 1024 - 4096  # format 2: a 256 KiB slot with its trailer, four to a 1 MiB segment: 16 pages fill four segment files


# ---------------------------------------------------------------------- the helpers
def failing(exc: BaseException, calls: list[str], name: str):
    def step():
        calls.append(name)
        raise exc
    return step


def test_every_step_runs_and_the_first_failure_is_raised_typed():
    calls: list[str] = []
    first, second = OSError(errno.ENOSPC, "full"), OSError(errno.EIO, "io")
    steps = [("a", failing(first, calls, "a")), ("b", lambda: calls.append("b")), ("c", failing(second, calls, "c"))]
    with pytest.raises(StoreCloseError) as info:
        close_all("shard", steps)
    assert calls == ["a", "b", "c"]
    assert info.value.__cause__ is first and info.value.failures == (("a", first), ("c", second))
    assert "a failed" in str(info.value) and "c also failed" in str(info.value)
    assert run_steps([("ok", lambda: None)]) == []
    close_all("shard", [("ok", lambda: None)])  # nothing failed: nothing raised


def test_release_all_re_raises_the_first_error_itself_with_the_others_as_notes():
    calls: list[str] = []
    first, second = OSError(errno.EIO, "one"), OSError(errno.EIO, "two")
    with pytest.raises(OSError) as info:
        release_all([("x", failing(first, calls, "x")), ("y", failing(second, calls, "y"))])
    assert info.value is first and calls == ["x", "y"]
    assert info.value.__notes__ == [f"y also failed: {second!r}"]


def test_an_interrupt_is_never_wrapped_nor_swallowed():
    calls: list[str] = []
    steps = [("a", failing(OSError(errno.EIO, "io"), calls, "a")), ("b", failing(KeyboardInterrupt(), calls, "b")),
             ("c", lambda: calls.append("c"))]
    with pytest.raises(KeyboardInterrupt):
        close_all("shard", steps)
    assert calls == ["a", "b", "c"]


def test_acquired_releases_newest_first_and_only_when_the_open_fails():
    calls: list[str] = []
    with Acquired("thing") as held:
        held.push("first", lambda: calls.append("first"))
    assert calls == []  # the open returned: the opened object owns it all now
    with pytest.raises(ValueError) as info:
        with Acquired("thing") as held:
            place = held.push("engine", lambda: calls.append("base engine"))
            held.push("lock", failing(OSError(errno.EIO, "io"), calls, "lock"))
            held.drop(place)
            held.push("engine", lambda: calls.append("engine stack"))  # the stack wrapping the base engine
            raise ValueError("open failed")
    assert calls == ["engine stack", "lock"]
    assert "lock failed too" in info.value.__notes__[0]  # the open's own error, with the release's as a note
    calls.clear()
    with pytest.raises(ValueError):
        with Acquired("thing") as held:
            held.push("lock", lambda: calls.append("lock"))
            held.hand_over([("journal", lambda: calls.append("journal")), ("lock", lambda: calls.append("lock"))])
            raise ValueError("fold failed")
    assert calls == ["journal", "lock"]  # handed-over steps run in their own order


# ---------------------------------------------------------------------- the store
@pytest.fixture
def threads_before():
    return kvtier_threads()


def populate(path, pages: int = 16, engine=None, page_bytes: int = PAGE_BYTES, **config):
    """A writer holding ``pages`` acknowledged pages and one acknowledged delete, read back in one batch
    (so the engine's threads run); returns (store, {key: bytes} of what it holds)."""
    store = open_writer(store_config(path, page_bytes=page_bytes, **config), namespace(page_bytes), engine=engine)
    mem = HostMemory(pages, page_bytes)
    expected = {key(i): mem.fill(i, 1000 + i) for i in range(pages)}
    assert store.put(list(expected), [mem.runs(i) for i in range(pages)]) == [True] * pages
    assert store.get(list(expected), [mem.runs(i) for i in range(pages)]) == [True] * pages
    assert store.delete([key(0)]) == 1
    del expected[key(0)]
    return store, expected


def assert_released(root, meta, threads_before) -> None:
    assert open_fds_under(root) == {}, "descriptors of the store left open"
    assert kvtier_threads() - threads_before == set(), "kvtier threads left running"
    assert lock_free_elsewhere(meta), "the writer lock is still held"


def assert_reattach(path, expected: dict, page_bytes: int = PAGE_BYTES, **config):
    """Open the writer again in this process; every page of ``expected`` is served, exact. Its recovery."""
    mem = HostMemory(max(1, len(expected)), page_bytes)
    with open_store(path, page_bytes=page_bytes, **config) as again:
        assert sorted(again.keys()) == sorted(expected)
        assert again.get(list(expected), [mem.runs(i) for i in range(len(expected))]) == [True] * len(expected)
        assert [mem.page(i).tobytes() for i in range(len(expected))] == list(expected.values())
        return again.recovery


@pytest.mark.parametrize("durability", ["batch", "always"])
@pytest.mark.parametrize(("call", "error"), [("write", errno.ENOSPC), ("fsync", errno.EIO)])
def test_checkpoint_write_fails(tmp_path, threads_before, durability, call, error, monkeypatch):
    store, expected = populate(tmp_path, durability=durability)
    meta = store.layout.meta
    assert kvtier_threads() - threads_before and not lock_free_elsewhere(meta)  # the checks below can fail
    faults = OSFaults(error, {call}, "checkpoint.bin")
    with monkeypatch.context() as m:
        m.setattr(devices, "os", faults)
        with pytest.raises(StoreCloseError) as info:
            store.close()
    assert faults.failed and [s for s, _ in info.value.failures] == ["checkpoint"]
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == error
    assert_released(tmp_path, meta, threads_before)
    store.close()  # idempotent, also after a failed close
    with pytest.raises(StoreClosedError):
        store.longest_prefix([key(1)])
    recovery = assert_reattach(tmp_path, expected, durability=durability)
    assert recovery.replayed_records > 0  # served from the journal: the checkpoint never landed


def test_journal_cannot_be_synced(tmp_path, threads_before, monkeypatch):
    store, expected = populate(tmp_path)
    meta = store.layout.meta
    with monkeypatch.context() as m:
        m.setattr(jw, "os", OSFaults(errno.EIO, {"fsync"}, "journal-"))
        with pytest.raises(StoreCloseError) as info:
            store.close()
    assert [s for s, _ in info.value.failures] == ["checkpoint"] and info.value.__cause__.errno == errno.EIO
    assert_released(tmp_path, meta, threads_before)
    assert assert_reattach(tmp_path, expected).replayed_records > 0


def test_next_journal_generation_cannot_be_written(tmp_path, threads_before, monkeypatch):
    store, expected = populate(tmp_path)
    meta = store.layout.meta
    nxt = jr.journal_path(meta, jr.journal_generations(meta)[-1] + 1)  # the one the close's checkpoint makes
    with monkeypatch.context() as m:
        m.setattr(jw, "os", OSFaults(errno.ENOSPC, {"write"}, nxt.name))
        with pytest.raises(StoreCloseError) as info:
            store.close()
    assert info.value.__cause__.errno == errno.ENOSPC
    assert not nxt.exists()  # the half-made journal was removed, its descriptor closed
    assert_released(tmp_path, meta, threads_before)
    recovery = assert_reattach(tmp_path, expected)
    assert recovery.replayed_records > 0 and recovery.problems == []


def test_store_directory_removed_before_close(tmp_path, threads_before):
    device = tmp_path / "dev"
    device.mkdir()
    store, _ = populate(device)
    meta = store.layout.meta
    shutil.rmtree(device)
    assert open_fds_under(tmp_path)  # the deleted files are still open, until close
    with pytest.raises(StoreCloseError) as info:
        store.close()
    assert [s for s, _ in info.value.failures] == ["checkpoint"]
    assert isinstance(info.value.__cause__, FileNotFoundError)
    device.mkdir()  # the operator puts a device back
    assert_released(tmp_path, meta, threads_before)
    assert assert_reattach(device, {}).problems == []  # a fresh, empty shard


def test_journal_close_fails(tmp_path, threads_before, monkeypatch):
    store, expected = populate(tmp_path)
    meta = store.layout.meta
    nxt = jr.journal_path(meta, jr.journal_generations(meta)[-1] + 1)
    with monkeypatch.context() as m:
        m.setattr(jw, "os", OSFaults(errno.EIO, {"close"}, nxt.name))
        with pytest.raises(StoreCloseError) as info:
            store.close()
    assert [s for s, _ in info.value.failures] == ["journal"] and info.value.__cause__.errno == errno.EIO
    assert_released(tmp_path, meta, threads_before)
    assert assert_reattach(tmp_path, expected).replayed_records == 0  # the checkpoint landed before


def test_segment_close_fails(tmp_path, threads_before, monkeypatch):
    store, expected = populate(tmp_path, page_bytes=BIG_PAGE)
    meta = store.layout.meta
    store.layout.settle()
    assert len(list(meta.glob("seg-*.dat"))) == 5  # 4 in use, the next made ahead
    faults = OSFaults(errno.EIO, {"close"}, "seg-")
    with monkeypatch.context() as m:
        m.setattr(devices, "os", faults)
        with pytest.raises(StoreCloseError) as info:
            store.close()
    assert len(faults.failed) == 5  # every segment's close was attempted, though each one failed
    assert [s for s, _ in info.value.failures] == ["devices"] and len(info.value.__cause__.__notes__) == 4
    assert_released(tmp_path, meta, threads_before)
    assert assert_reattach(tmp_path, expected, page_bytes=BIG_PAGE).replayed_records == 0


class FailingCloseEngine(EngineWrapper):
    """Stops its threads, then reports a failure (or raises ``error``)."""

    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error

    def close(self) -> None:
        super().close()
        raise self.error


def test_engine_close_fails(tmp_path, threads_before):
    store, expected = populate(tmp_path, engine=FailingCloseEngine(RuntimeError("stuck")))
    meta = store.layout.meta
    with pytest.raises(StoreCloseError) as info:
        store.close()
    assert [s for s, _ in info.value.failures] == ["io engine"] and isinstance(info.value.__cause__, RuntimeError)
    assert_released(tmp_path, meta, threads_before)
    assert assert_reattach(tmp_path, expected).replayed_records == 0


def test_an_interrupt_while_closing_still_releases_everything(tmp_path, threads_before):
    store, expected = populate(tmp_path, engine=FailingCloseEngine(KeyboardInterrupt()))
    meta = store.layout.meta
    with pytest.raises(KeyboardInterrupt):
        store.close()
    assert_released(tmp_path, meta, threads_before)
    assert_reattach(tmp_path, expected)


def test_writer_lock_close_fails(tmp_path, threads_before, monkeypatch):
    store, expected = populate(tmp_path)
    meta = store.layout.meta
    with monkeypatch.context() as m:
        m.setattr(writers, "os", OSFaults(errno.EIO, {"close"}, "LOCK"))
        with pytest.raises(StoreCloseError) as info:
            store.close()
    assert [s for s, _ in info.value.failures] == ["writer lock"]
    assert_released(tmp_path, meta, threads_before)  # unlocked explicitly before the close that failed
    assert_reattach(tmp_path, expected)


def test_several_failures_raise_the_first_and_name_them_all(tmp_path, threads_before, monkeypatch):
    store, expected = populate(tmp_path, page_bytes=BIG_PAGE)
    meta = store.layout.meta
    with monkeypatch.context() as m:
        m.setattr(devices, "os", OSFaults(errno.ENOSPC, {"write", "close"}, ""))  # checkpoint write, segments
        with pytest.raises(StoreCloseError) as info:
            store.close()
    assert [s for s, _ in info.value.failures] == ["checkpoint", "devices"]
    assert info.value.__cause__.errno == errno.ENOSPC and "devices also failed" in str(info.value)
    assert_released(tmp_path, meta, threads_before)
    assert_reattach(tmp_path, expected, page_bytes=BIG_PAGE)


def test_a_failing_close_does_not_hide_the_error_of_the_with_block(tmp_path, threads_before, monkeypatch):
    with monkeypatch.context() as m:
        with pytest.raises(ValueError, match="the block's own") as info:
            with open_store(tmp_path) as store:
                meta = store.layout.meta
                m.setattr(devices, "os", OSFaults(errno.ENOSPC, {"write"}, "checkpoint.bin"))
                raise ValueError("the block's own error")
    assert "closing the shard failed too" in info.value.__notes__[0]
    assert_released(tmp_path, meta, threads_before)


def test_reader_close_fails_on_a_segment(tmp_path, threads_before, monkeypatch):
    writer, expected = populate(tmp_path, page_bytes=BIG_PAGE)
    writer.close()
    reader = PageReader.open(store_config(tmp_path, page_bytes=BIG_PAGE), namespace(BIG_PAGE))
    mem = HostMemory(len(expected), BIG_PAGE)
    assert reader.get(list(expected), [mem.runs(i) for i in range(len(expected))]) == [True] * len(expected)
    with monkeypatch.context() as m:
        m.setattr(devices, "os", OSFaults(errno.EIO, {"close"}, "seg-"))
        with pytest.raises(StoreCloseError) as info:
            reader.close()
    assert [s for s, _ in info.value.failures] == ["devices"]
    assert_released(tmp_path, writer.layout.meta, threads_before)
    reader.close()  # idempotent
    assert_reattach(tmp_path, expected, page_bytes=BIG_PAGE)
