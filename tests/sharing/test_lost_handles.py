"""Descriptors lost for good (``store.lost_handles``): a FUSE client that died and was mounted again leaves every
descriptor of the old mount answering ENOTCONN, while fresh opens work (``dead_mount.DeadMount`` emulates it
in one process; tests/sharing/test_fs_lab_faults.py kills a real JuiceFS client).

A writer's store refuses writes without raising, gives itself up, and the pool re-registers in a fresh
directory once the filesystem answers again; the pages of the directory given up are served again through
fresh descriptors. A follower reads a page again through a fresh descriptor of its segment. A lease stops on
such an error, saying why. Every read is checked byte for byte; clocks are injected; no sleeps.
"""

from __future__ import annotations

import errno
from typing import Any

import pytest
from dead_mount import DeadMount
from support import HostMemory, key, namespace
from test_announced import PAGE, Pages, beat, cluster_config
from test_stale_view import Clock

from sgl_kvtier.io.engine import ThreadPoolEngine
from sgl_kvtier.sharing import fencing
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.sharing.lease import Lease
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.store.lost_handles import handle_lost

INTERVAL = 5.0
CALM = {"breaker_failures": 10_000}  # failed IO while the mount is down never opens a breaker here


def put_one(pool: SharedPool, n: int) -> list[bool]:
    mem = HostMemory(1, PAGE)
    mem.fill(0, n)
    return pool.put([key(n)], [mem.runs(0)])


def test_which_errors_say_a_descriptor_is_lost_for_good():
    for code in (errno.ENOTCONN, errno.EBADF, errno.ESTALE):
        assert handle_lost(OSError(code, "x"))
    for exc in (OSError(errno.EIO, "x"), OSError(errno.ENOSPC, "x"), FileNotFoundError(), ValueError(), None):
        assert not handle_lost(exc)


def test_a_writer_whose_mount_died_refuses_writes_and_re_registers_once_the_filesystem_is_back(tmp_path, monkeypatch):
    monkeypatch.setattr(fencing, "PEER_RETRY_S", 0.0)  # a failed re-registration is tried again at the next write
    pages = Pages()
    with SharedPool.open_writer(cluster_config(tmp_path, "ha", **CALM), namespace(PAGE)) as a:
        pages.put(a, [1, 2, 3])
        beat(a)  # announced: a follower of this directory sees them
        old = a.own
        assert old is not None and old.lease is not None
        mount = DeadMount(tmp_path, monkeypatch)
        assert mount.kill() >= 5  # LOCK, LEASE, FENCE, the journal, a segment

        assert put_one(a, 4) == [False]  # refused, no error: the journal's sync answered ENOTCONN
        assert old.fenced is not None and "ENOTCONN" in old.fenced and old.lease.fenced == old.fenced
        assert pages.hits(a, [1, 2, 3]) == []  # misses: its segment's descriptor is dead
        assert put_one(a, 5) == [False] and a.own is old  # re-registering fails while the mount is down
        assert a.sharing_stats()["fenced_pages"] == 1 and a.sharing_stats()["reregistrations"] == 0

        mount.remount()
        pages.put(a, [6])  # a fresh writer directory, fresh descriptors
        assert a.own is not old and a.wid == "ha-1" and a.sharing_stats()["reregistrations"] == 1
        # The directory given up keeps its pages: followed as a peer through fresh descriptors.
        assert pages.hits(a, [1, 2, 3, 6]) == [1, 2, 3, 6]
        assert set(a.peers()) == {"ha-0"} and mount.refused > 0


def test_a_writer_error_that_leaves_the_descriptors_working_refuses_the_put_and_keeps_the_store(tmp_path, monkeypatch):
    pages = Pages()
    with SharedPool.open_writer(cluster_config(tmp_path, "ha"), namespace(PAGE)) as a:
        own = a.own
        assert own is not None
        journal = own._journal
        real_sync = journal.sync
        fail = [OSError(errno.EIO, "Input/output error")]

        def sync() -> None:
            if fail:
                raise fail.pop()
            real_sync()

        monkeypatch.setattr(journal, "sync", sync)
        assert put_one(a, 1) == [False] and a.counters.io_errors == 1  # not acknowledged: refused, no error
        assert own.fenced is None and a.own is own
        pages.put(a, [2])
        assert pages.hits(a, [2]) == [2] and a.wid == "ha-0"


def test_a_follower_reads_a_page_again_through_a_fresh_descriptor_once_the_mount_is_back(tmp_path, monkeypatch):
    pages, clock = Pages(), Clock()
    with SharedPool.open_writer(cluster_config(tmp_path, "ha"), namespace(PAGE)) as a:  # closed: its files stay
        pages.put(a, [1, 2])
        beat(a)
        wid, ns = a.wid, a.namespace
    config = cluster_config(tmp_path, "hb", follow_interval_s=INTERVAL, **CALM)
    with PageReader.open(config, ns, wid=wid, engine=ThreadPoolEngine(2), follows_peer=True, clock=clock) as reader:
        assert pages.hits(reader, [1, 2]) == [1, 2]  # its segment is open from here on
        mount = DeadMount(tmp_path, monkeypatch)
        assert mount.kill() == 1
        assert pages.hits(reader, [1]) == []  # down: the fresh open fails too, a miss
        mount.remount()
        assert pages.hits(reader, [1]) == []  # tried once per interval: the try while down counts
        clock.t += INTERVAL
        assert pages.hits(reader, [1, 2]) == [1, 2]  # the dead descriptor answered ENOTCONN; a fresh one served
        assert reader.counters.segments_reopened == 1 and reader.counters.fresh_rereads == 1  # page 2: fresh already
        assert reader.counters.io_errors == 3  # 1 while down, then 1 after: a try within the interval, 1 renewed


class LostBlocks:
    """Lease blocks on a mount whose client died."""

    def write_block(self, index: int, data: bytes) -> None:
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    def close(self) -> None:
        pass


def test_a_lease_whose_descriptors_are_lost_stops_and_says_why(tmp_path):
    stopped: list[str] = []
    usage: dict[str, Any] = {}
    lease = Lease(tmp_path / "LEASE", {"wid": "ha-0"}, lambda: usage, 600.0, blocks=LostBlocks())
    lease.on_fenced = stopped.append
    lease.start()  # its first beat runs here, on this thread
    try:
        assert lease.fenced is not None and "ENOTCONN" in lease.fenced and stopped == [lease.fenced]
        assert lease.failures == 1 and lease.last_beat is None
        lease.beat()  # stopped: no write is tried again
        assert lease.failures == 1
    finally:
        lease.close()


def test_a_lease_beat_failing_otherwise_goes_on(tmp_path):
    class Failing(LostBlocks):
        def write_block(self, index: int, data: bytes) -> None:
            raise OSError(errno.EIO, "Input/output error")

    lease = Lease(tmp_path / "LEASE", {"wid": "ha-0"}, lambda: {}, 600.0, blocks=Failing())
    lease.start()
    try:
        assert lease.fenced is None and lease.failures == 1
        with pytest.raises(OSError):
            lease.beat()  # not stopped: the next beat writes again
    finally:
        lease.close()
