"""Who is alive (``sharing.liveness``): verdicts on the observer's own injected clock, fences, the owner's side.

Two "hosts" are two configs with different ``host_id`` on one directory (``sharing = "cluster"``). Lease
threads stay idle (``heartbeat_s`` = 600); tests beat leases themselves and move fake clocks. No sleeps.
"""

from __future__ import annotations

import os
from pathlib import Path

from support import HostMemory, key, namespace, store_config
from test_sharing import PAGE

from sgl_kvtier.sharing import liveness
from sgl_kvtier.sharing.lease import Lease, read_lease
from sgl_kvtier.sharing.liveness import FENCE, LeaseWatch, OwnFence, Verdict, read_fence
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.sharing.retire import write_fence
from sgl_kvtier.store import format as fmt

DEAD_S, RECLAIM_S = 2000.0, 5000.0  # dead_after_s must exceed 3 heartbeats (600 s each here)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def cluster_config(path: Path, host: str, capacity_pages: int = 64, **extra):
    extra.setdefault("sharing", "cluster")
    return store_config(path, capacity_pages, PAGE, heartbeat_s=600.0, follow_interval_s=0.0, host_id=host,
                        allow_local_fs=True, dead_after_s=DEAD_S, reclaim_after_s=RECLAIM_S, **extra)


def lease_of(pool: SharedPool) -> dict:
    assert pool.own is not None
    lease = read_lease(pool.own.layout.meta / "LEASE")
    assert lease is not None
    return lease


def test_another_hosts_writer_is_live_while_it_beats_dead_after_dead_after_s_and_live_again(tmp_path):
    cb = Clock()
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), namespace(PAGE)) as a, \
            SharedPool.open_writer(cluster_config(tmp_path, "hostb"), namespace(PAGE), clock=cb) as b:
        assert a.own is not None and a.own.lease is not None and a.wid is not None
        b.refresh(force=True)
        first = b.verdict(a.wid)
        assert first.verdict is Verdict.LIVE and not first.same_host and first.unchanged_s == 0.0
        for _ in range(3):  # it beats: its mark moves under b's watch, however much b's clock advances
            cb.t += DEAD_S
            a.own.lease.beat()
            b.refresh(force=True)
            assert b.verdict(a.wid).verdict is Verdict.LIVE and b.peer_alive(a.wid) is True
        cb.t += DEAD_S - 1  # silent, but not long enough
        b.refresh(force=True)
        assert b.verdict(a.wid).verdict is Verdict.LIVE
        cb.t += 1
        b.refresh(force=True)
        dead = b.verdict(a.wid)
        assert dead.verdict is Verdict.DEAD and dead.unchanged_s == DEAD_S and b.peer_alive(a.wid) is False
        assert b.peers().keys() == {a.wid}  # dead but readable: its pages stay until it is retired
        a.own.lease.beat()  # it resumes
        b.refresh(force=True)
        assert b.verdict(a.wid).verdict is Verdict.LIVE and b.peer_alive(a.wid) is True


def test_an_observer_started_late_presumes_a_silent_writer_live_at_first(tmp_path):
    ca = Clock()
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), namespace(PAGE)) as a:
        assert a.wid is not None
        ca.t += 10 * DEAD_S  # a has been silent for long; a new observer cannot know that
        with SharedPool.open_writer(cluster_config(tmp_path, "hostb"), namespace(PAGE), clock=ca) as b:
            assert b.verdict(a.wid).verdict is Verdict.LIVE
            ca.t += DEAD_S
            assert b.verdict(a.wid).verdict is Verdict.DEAD


def test_same_host_writers_are_judged_by_their_lock_never_by_time(tmp_path):
    clock = Clock()
    cfg = cluster_config(tmp_path, "hosta")
    with SharedPool.open_writer(cfg, namespace(PAGE), clock=clock) as a:
        b = SharedPool.open_writer(cfg, namespace(PAGE))
        wid = b.wid
        assert wid is not None
        clock.t += 10 * RECLAIM_S
        judged = a.verdict(wid)
        assert judged.verdict is Verdict.LIVE and judged.same_host  # its LOCK is held, whatever the clock
        b.close()
        assert a.verdict(wid).verdict is Verdict.DEAD  # the LOCK is free: dead at once


def test_a_fence_retires_only_the_incarnation_it_names_and_only_in_cluster_mode(tmp_path):
    clock = Clock()
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), namespace(PAGE)) as a:
        assert a.own is not None and a.wid is not None
        directory = a.own.layout.meta
        lease = lease_of(a)
        assert (directory / FENCE).exists() and read_fence(directory) is None  # made empty by the owner at open
        watch = LeaseWatch(cluster_config(tmp_path, "hostb"), clock)
        assert write_fence(directory, b"x" * 16, "hostb-0", "hostb") is False  # the lease names another one
        assert read_fence(directory) is None
        fd = os.open(directory / FENCE, os.O_WRONLY)  # an earlier incarnation's fence, left in place
        os.pwrite(fd, fmt.pack_fence_block({"incarnation": b"x" * 16, "by": "hostb-0", "by_host": "hostb", "at": 0.0}), 0)
        os.close(fd)
        assert read_fence(directory) is not None
        assert watch.judge(directory, lease).verdict is Verdict.LIVE
        write_fence(directory, lease["incarnation"], "hostb-0", "hostb")
        judged = watch.judge(directory, lease)
        assert judged.verdict is Verdict.RETIRED and "hostb-0" in judged.reason
        assert watch.judge(directory, None).verdict is Verdict.RETIRED  # its LEASE deleted already
        host_watch = LeaseWatch(cluster_config(tmp_path, "hostb", sharing="host"), clock)
        assert host_watch.judge(directory, lease).verdict is Verdict.LIVE  # host mode reads no fence


def test_reclaim_due_counts_from_the_last_change_like_dead_after(tmp_path):
    clock = Clock()
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), namespace(PAGE)) as a:
        assert a.own is not None
        watch = LeaseWatch(cluster_config(tmp_path, "hostb"), clock)
        directory, lease = a.own.layout.meta, lease_of(a)
        watch.judge(directory, lease)
        clock.t += RECLAIM_S - 1
        judged = watch.judge(directory, lease)
        assert judged.verdict is Verdict.DEAD and not watch.reclaim_due(judged)
        clock.t += 1
        assert watch.reclaim_due(watch.judge(directory, lease))


def test_own_fence_names_this_incarnation_or_is_gone(tmp_path):
    fence = OwnFence(tmp_path, b"i" * 16)
    assert (tmp_path / FENCE).stat().st_size == 0 and fence.check() is None
    write_fence(tmp_path, b"o" * 16, "hostb-0", "hostb")
    assert fence.check() is None and fence.check(any_incarnation=True) is not None
    write_fence(tmp_path, b"i" * 16, "hostb-1", "hostb")
    reason = fence.check()
    assert reason is not None and "hostb-1" in reason
    fence.close()
    again = OwnFence(tmp_path, b"j" * 16)  # an existing FENCE is opened, never truncated
    assert again.check(any_incarnation=True) is not None
    os.unlink(tmp_path / FENCE)  # a retirer deleted it: only ever after fencing
    assert again.check() == "its FENCE was deleted (retired)"
    again.close()
    again.close()


def test_a_fenced_lease_stops_beating_and_says_so_once(tmp_path):
    calls: list[str] = []
    fence = OwnFence(tmp_path, b"i" * 16)
    lease = Lease(tmp_path / "LEASE", {"wid": "h-0", "incarnation": b"i" * 16}, lambda: {"pages": 1}, 600.0)
    lease.fence_check, lease.on_fenced = fence.check, calls.append
    lease.after_beat = lambda: calls.append("step")
    lease.beat()
    assert calls == ["step"] and lease.counter == 1
    write_fence(tmp_path, b"i" * 16, "hostb-0", "hostb")
    lease.beat()
    lease.beat()
    assert lease.counter == 1 and lease.fenced is not None and calls == ["step", lease.fenced]
    got = read_lease(tmp_path / "LEASE")
    assert got is not None and got["counter"] == 0  # nothing written since the fence
    lease.close()
    fence.close()


def test_a_fence_block_round_trips_and_a_torn_one_is_none(tmp_path):
    assert not write_fence(tmp_path, b"i" * 16, "hostb-0", "hostb")  # no FENCE, no LEASE: nobody to fence
    (tmp_path / "LEASE").touch()  # a writer of an older build: a lease and no FENCE, which is created
    assert write_fence(tmp_path, b"i" * 16, "hostb-0", "hostb")
    got = read_fence(tmp_path)
    assert got is not None and got["incarnation"] == b"i" * 16 and got["by"] == "hostb-0"
    data = bytearray((tmp_path / FENCE).read_bytes())
    assert len(data) == fmt.LEASE_BLOCK_BYTES
    data[20] ^= 0xFF
    (tmp_path / FENCE).write_bytes(bytes(data))
    assert read_fence(tmp_path) is None and read_fence(tmp_path / "absent") is None


def test_host_mode_pools_make_no_fence(tmp_path):
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta", sharing="host"), namespace(PAGE)) as a:
        assert a.own is not None and not (a.own.layout.meta / FENCE).exists()
        mem = HostMemory(1, PAGE)
        mem.fill(0, 1)
        assert a.put([key(1)], [mem.runs(0)]) == [True]


def test_an_older_read_of_the_same_incarnation_is_no_change(tmp_path):
    """Two readers of one pool (its last refresh, the quota's fresh read) feed one watch: a lease read
    before the last one recorded must not count as the writer advancing, or a dead writer never dies."""
    now = [0.0]
    config = store_config(tmp_path, host_id="a", sharing="cluster", allow_local_fs=True, dead_after_s=10.0,
                          heartbeat_s=1.0)
    watch = LeaseWatch(config, clock=lambda: now[0])
    other = tmp_path / "w-b-0"
    other.mkdir()
    old, new = ({"host_id": "b", "counter": c, "incarnation": b"i" * 16} for c in (4, 5))
    watch.judge(other, old)
    now[0] = 1.0
    watch.judge(other, new)  # it beat once
    for t in range(2, 13):
        now[0] = float(t)
        judged = watch.judge(other, old if t % 2 else new)  # alternating stale and fresh reads
    assert judged.verdict is Verdict.DEAD and judged.unchanged_s >= 10.0


def test_a_refresh_reads_a_peers_fence_again_only_when_its_lease_moved_or_heartbeat_s_passed(tmp_path, monkeypatch):
    """The pool's refresh (every follow_interval_s, here 0, and on shortfalls) is a hot path: an unchanged
    lease costs no FENCE read until heartbeat_s passed on the observer's clock; a moved one costs one."""
    reads: list[str] = []
    real = liveness.read_fence
    monkeypatch.setattr(liveness, "read_fence", lambda d: (reads.append(Path(d).name), real(d))[1])
    cb = Clock()
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), namespace(PAGE)) as a, \
            SharedPool.open_writer(cluster_config(tmp_path, "hostb"), namespace(PAGE), clock=cb) as b:
        assert a.own is not None and a.own.lease is not None and a.wid is not None
        name, heartbeat_s = f"w-{a.wid}", b.config.heartbeat_s

        def reads_over(refreshes: int) -> int:
            before = reads.count(name)
            for _ in range(refreshes):
                b.refresh(force=True)
            return reads.count(name) - before

        assert reads.count(name) == 1 and b.peers().keys() == {a.wid}  # newly seen by b's open: read once
        assert reads_over(20) == 0  # its lease unchanged: not read again
        a.own.lease.beat()  # its counter advances
        assert reads_over(1) == 1 and reads_over(20) == 0
        cb.t += heartbeat_s - 1
        assert reads_over(5) == 0
        cb.t += 1  # the periodic re-check, lease unchanged
        assert reads_over(1) == 1 and reads_over(5) == 0
        # A retirer fences it (its lease unchanged: it is paused): a refresh notices within heartbeat_s.
        write_fence(a.own.layout.meta, lease_of(a)["incarnation"], "hostc-0", "hostc")
        assert reads_over(3) == 0 and b.peers().keys() == {a.wid}
        cb.t += heartbeat_s
        assert reads_over(1) == 1 and b.peers() == {} and b.sharing_stats()["peers_dropped"] == 1
        assert b.verdict(a.wid).verdict is Verdict.RETIRED


def test_a_judged_fence_is_seen_by_the_next_refresh_at_once(tmp_path, monkeypatch):
    """``judge`` (quota step, inspect) always reads the FENCE; what it read is what the next refresh uses."""
    reads: list[str] = []
    real = liveness.read_fence
    monkeypatch.setattr(liveness, "read_fence", lambda d: (reads.append(Path(d).name), real(d))[1])
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), namespace(PAGE)) as a, \
            SharedPool.open_writer(cluster_config(tmp_path, "hostb"), namespace(PAGE), clock=Clock()) as b:
        assert a.own is not None and a.wid is not None
        name = f"w-{a.wid}"
        b.refresh(force=True)
        write_fence(a.own.layout.meta, lease_of(a)["incarnation"], "hostc-0", "hostc")
        before = reads.count(name)
        assert b.verdict(a.wid).verdict is Verdict.RETIRED and reads.count(name) == before + 1
        b.refresh(force=True)  # no clock advance, no lease change: the judged fence drops it
        assert b.peers() == {} and reads.count(name) == before + 1
