"""``sharing = "cluster"``: a reader replays a writer's journals only as far as the writer's lease announced
(``journal.follow_announced`` through ``PageReader.refresh``); ``sharing = "host"`` follows the files as
they grow. Two writers (two host ids) on one directory; their lease threads stay idle (``heartbeat_s`` =
600: one beat at open) and a test beats a writer itself. No sleeps: refreshes are forced.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support import HostMemory, key, namespace, store_config

from sgl_kvtier.io.file_view import PosixView
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.sharing.lease import read_lease
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store import journal_write as jw
from sgl_kvtier.store.meta import LEASE

PAGE = 16 * 1024 - 4096  # a 16 KiB slot with its trailer


def cluster_config(path: Path, host: str, capacity_pages: int = 64, **extra: Any):
    extra.setdefault("sharing", "cluster")
    if extra["sharing"] == "cluster":
        extra.update(allow_local_fs=True, dead_after_s=3600.0, reclaim_after_s=3600.0)
    extra.setdefault("follow_interval_s", 0.0)
    return store_config(path, capacity_pages, PAGE, heartbeat_s=600.0, host_id=host, **extra)


class Pages:
    """Pages derived from their key number; every hit is checked byte for byte against what was put."""

    def __init__(self) -> None:
        self.mem = HostMemory(1, PAGE)
        self.expected: dict[int, bytes] = {}
        self.wrong: list[int] = []

    def put(self, pool: SharedPool, numbers: list[int]) -> None:
        for n in numbers:
            self.expected[n] = self.mem.fill(0, n)
            assert pool.put([key(n)], [self.mem.runs(0)]) == [True]

    def hits(self, reader: SharedPool | PageReader, numbers: list[int]) -> list[int]:
        """The numbers ``reader`` returns; a hit with other bytes than were put is recorded in ``wrong``."""
        got = []
        for n in numbers:
            self.mem.clear()
            if reader.get([key(n)], [self.mem.runs(0)]) == [True]:
                got.append(n)
                if self.mem.page(0).tobytes() != self.expected[n]:
                    self.wrong.append(n)
        assert self.wrong == []
        return got


def beat(pool: SharedPool) -> dict[str, Any]:
    """Beat ``pool``'s own lease now; what it announced."""
    assert pool.own is not None and pool.own.lease is not None
    pool.own.lease.beat()
    lease = read_lease(pool.own.layout.meta / LEASE)
    assert lease is not None
    return lease


def peer_of(pool: SharedPool, other: SharedPool) -> PageReader:
    assert other.wid is not None
    return pool.peers()[other.wid]


def two_writers(path: Path, **extra: Any) -> tuple[SharedPool, SharedPool]:
    ns = namespace(PAGE)
    a = SharedPool.open_writer(cluster_config(path, "ha", **extra), ns)
    try:
        b = SharedPool.open_writer(cluster_config(path, "hb", **extra), ns)
    except BaseException:
        a.close()
        raise
    return a, b


class Recording(PosixView):
    """The plain view, recording every path it is asked about."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def read(self, path: Path, offset: int = 0, limit: int | None = None) -> bytes:
        self.paths.append(path.name)
        return super().read(path, offset, limit)

    def size(self, path: Path) -> int:
        self.paths.append(path.name)
        return super().size(path)

    def exists(self, path: Path) -> bool:
        self.paths.append(path.name)
        return super().exists(path)

    def listdir(self, path: Path) -> list[str]:
        self.paths.append(path.name + "/")
        return super().listdir(path)


# ---------------------------------------------------------------------- bounded by the announcement
def test_pages_stay_invisible_until_the_writers_lease_announces_them(tmp_path):
    pages = Pages()
    a, b = two_writers(tmp_path)
    with a, b:
        pages.put(a, [1, 2, 3, 4])
        b.refresh(force=True)
        assert b.longest_prefix([key(n) for n in (1, 2, 3, 4)]) == 0 and pages.hits(b, [1, 2, 3, 4]) == []
        assert a.wid is not None
        with PageReader.open(b.config, a.namespace, wid=a.wid) as fresh:
            assert len(fresh) == 0  # opened now: bounded by the lease too
        beat(a)
        b.refresh(force=True)
        assert b.longest_prefix([key(n) for n in (1, 2, 3, 4)]) == 4 and pages.hits(b, [1, 2, 3, 4]) == [1, 2, 3, 4]
        with PageReader.open(b.config, a.namespace, wid=a.wid) as fresh:
            assert len(fresh) == 4


def test_host_mode_follows_the_journal_as_it_grows(tmp_path):
    pages = Pages()
    a, b = two_writers(tmp_path, sharing="host")
    with a, b:
        pages.put(a, [1, 2])
        b.refresh(force=True)
        assert pages.hits(b, [1, 2]) == [1, 2]  # no beat needed


def test_a_reader_replays_exactly_up_to_the_announced_bytes(tmp_path):
    pages = Pages()
    a, b = two_writers(tmp_path)
    with a, b:
        pages.put(a, [1, 2])
        announced = beat(a)["journal"]
        pages.put(a, [3, 4])  # appended and synced, not announced yet
        b.refresh(force=True)
        assert peer_of(b, a).recovery.cursor == tuple(announced)
        assert pages.hits(b, [1, 2, 3, 4]) == [1, 2]
        assert beat(a)["journal"][1] > announced[1]
        b.refresh(force=True)
        assert pages.hits(b, [1, 2, 3, 4]) == [1, 2, 3, 4]
        assert a.delete([key(2)]) == 1
        b.refresh(force=True)
        assert peer_of(b, a).contains(key(2))  # the DEL is not announced yet: the old page still shows
        assert pages.hits(b, [2]) == [2]  # and its bytes are still good
        beat(a)
        b.refresh(force=True)
        assert pages.hits(b, [1, 2, 3, 4]) == [1, 3, 4]


@pytest.mark.parametrize("how", ["torn", "missing"])
def test_without_a_readable_lease_nothing_new_is_replayed(tmp_path, how):
    pages = Pages()
    a, b = two_writers(tmp_path)
    with a, b:
        pages.put(a, [1])
        beat(a)
        b.refresh(force=True)
        assert pages.hits(b, [1]) == [1]
        assert a.own is not None
        path = a.own.layout.meta / LEASE
        if how == "torn":
            with open(path, "r+b") as f:  # both blocks: neither is valid any more
                f.write(b"\xff" * (2 * fmt.LEASE_BLOCK_BYTES))
        else:
            os.rename(path, path.with_name("LEASE.away"))
        pages.put(a, [2])
        b.refresh(force=True)
        assert pages.hits(b, [1, 2]) == [1]  # the previous view stays; nothing new
        if how == "missing":
            os.rename(path.with_name("LEASE.away"), path)
        beat(a)
        b.refresh(force=True)
        assert pages.hits(b, [1, 2]) == [1, 2]


def test_generations_are_followed_across_checkpoints_only_once_announced(tmp_path):
    pages = Pages()
    a, b = two_writers(tmp_path)
    with a, b:
        pages.put(a, [1, 2])
        beat(a)
        b.refresh(force=True)
        for round_ in range(3):  # three checkpoints between two beats: the journals b followed are gone
            pages.put(a, [10 + round_])
            a.checkpoint()
        pages.put(a, [20])
        assert a.delete([key(1)]) == 1
        b.refresh(force=True)
        assert pages.hits(b, [1, 2, 10, 11, 12, 20]) == [1, 2]  # nothing announced: the old view stays
        beat(a)
        b.refresh(force=True)
        assert pages.hits(b, [1, 2, 10, 11, 12, 20]) == [2, 10, 11, 12, 20]
        assert set(peer_of(b, a).keys()) == set(a.own.keys() if a.own else ())


def test_names_never_announced_are_never_looked_up(tmp_path):
    """The rule that keeps a negative lookup cache from hiding a journal: no probe of a name before the
    writer announced its generation; and a refresh with nothing new announced reads the lease alone."""
    pages = Pages()
    a, b = two_writers(tmp_path)
    view = Recording()
    with a, b:
        pages.put(a, [1])
        beat(a)
        assert a.wid is not None and a.own is not None
        with PageReader.open(b.config, a.namespace, wid=a.wid, view=view) as reader:
            assert reader.contains(key(1))
            gen = a.own.lease.usage()["journal"][0]
            view.paths.clear()
            assert reader.refresh() is False
            assert view.paths == [LEASE]  # nothing new: one lease read, no journal touched
            a.checkpoint()  # journal gen + 1 now exists, not announced
            pages.put(a, [2])
            view.paths.clear()
            assert reader.refresh() is False
            assert jr.journal_path(a.own.layout.meta, gen + 1).name not in view.paths
            assert view.paths == [LEASE]
            beat(a)
            assert reader.refresh() is True and reader.contains(key(2))


# ---------------------------------------------------------------------- torn, short, zero tails
def _journal_with(meta: Path, numbers: list[int]) -> tuple[jw.Journal, list[int]]:
    """A journal of PUT records for ``numbers``; the offset after each record."""
    journal = jw.Journal(meta, 0)
    ends = []
    for n in numbers:
        journal.append([jw.put_record(n, key(n), n, n, None)])
        ends.append(journal.size)
    journal.sync()
    return journal, ends


@pytest.mark.parametrize("mode", ["host", "cluster"])
@pytest.mark.parametrize("tail", ["torn", "zeros"])
def test_a_torn_or_zero_tail_is_resumed_from_the_last_whole_record(tmp_path, mode, tail):
    journal, ends = _journal_with(tmp_path, [1, 2])
    state = jr.recover(tmp_path, announced={0: ends[-1]} if mode == "cluster" else None)
    assert state.cursor == (0, ends[-1]) and set(state.slot_of) == {key(1), key(2)}
    record = jw.put_record(3, key(3), 3, 3, None)
    fd = os.open(jr.journal_path(tmp_path, 0), os.O_WRONLY)
    try:
        at = ends[-1]
        # What a reader may see of an append in flight: part of the record, or the file grown over zeros.
        os.pwrite(fd, record[:len(record) // 2] if tail == "torn" else bytes(len(record)), at)

        def follow() -> bool:
            if mode == "cluster":  # the lease already announces the whole record
                return jr.follow_announced(tmp_path, state, {0: at + len(record)})
            return jr.follow(tmp_path, state)

        for _ in range(2):
            assert follow() is False
            assert state.cursor == (0, at) and key(3) not in state.slot_of and state.problems == []
        os.pwrite(fd, record, at)
        assert follow() is True
        assert state.cursor == (0, at + len(record)) and state.slot_of[key(3)] == 3
    finally:
        os.close(fd)
        journal.close()


def test_a_lower_generation_seen_short_of_what_was_announced_is_not_left(tmp_path):
    journal, ends = _journal_with(tmp_path, [1, 2, 3])
    journal.close()
    nxt = jw.Journal(tmp_path, 1)
    nxt.append([jw.put_record(4, key(4), 4, 4, None)])
    nxt.sync()
    nxt.close()
    state = jr.recover(tmp_path, announced={0: ends[0]})
    assert state.cursor == (0, ends[0]) and set(state.slot_of) == {key(1)}
    data = jr.journal_path(tmp_path, 0).read_bytes()

    class Short(PosixView):  # generation 0 seen cut exactly after its second record (a stale size)
        def read(self, path: Path, offset: int = 0, limit: int | None = None) -> bytes:
            if path.name == jr.journal_path(tmp_path, 0).name:
                return data[offset:ends[1]]
            return super().read(path, offset, limit)

    announced = {0: ends[2], 1: nxt.size}  # the leases announced all of generation 0, then generation 1
    assert jr.follow_announced(tmp_path, state, announced, Short()) is True
    assert state.cursor == (0, ends[1]) and key(4) not in state.slot_of  # not left with a record missing
    assert jr.follow_announced(tmp_path, state, announced) is True
    assert state.cursor == (1, nxt.size) and set(state.slot_of) == {key(1), key(2), key(3), key(4)}
