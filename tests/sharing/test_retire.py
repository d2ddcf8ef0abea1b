"""Retiring dead writers of other hosts and fencing zombies (``sharing.retire``, ``sharing.fencing``).

Two "hosts" are two configs with different ``host_id`` on one directory (``sharing = "cluster"``,
``allow_local_fs``); real worker processes get a ``KVTIER_BOOT_ID`` of their own too. Lease threads stay
idle (``heartbeat_s`` = 600): a test beats a writer itself (``Lease.beat`` runs its quota step) and moves
the observer's injected clock. Every page read is checked byte for byte. No sleeps. Races between
retirers, and with the writer they retire: ``test_retire_races``.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from support import HostMemory, key, namespace, run_concurrently
from test_liveness import DEAD_S, RECLAIM_S, Clock, cluster_config
from test_sharing import PAGE, opened

from sgl_kvtier.sharing import retire as rt
from sgl_kvtier.sharing.lease import read_lease
from sgl_kvtier.sharing.liveness import Verdict
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.sharing.quota_loop import QuotaStep

NS = namespace(PAGE)


def put(pool: SharedPool, numbers: list[int]) -> list[bool]:
    mem = HostMemory(1, PAGE)
    out: list[bool] = []
    for n in numbers:
        mem.fill(0, n)
        out += pool.put([key(n)], [mem.runs(0)])
    return out


def read(pool: SharedPool, numbers: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(hits, misses, wrong) over ``numbers``, each page checked against its bytes."""
    mem, want = HostMemory(1, PAGE), HostMemory(1, PAGE)
    hits, misses, wrong = [], [], []
    for n in numbers:
        mem.clear()
        ok = pool.get([key(n)], [mem.runs(0)]) == [True]
        (misses if not ok else hits if mem.page(0).tobytes() == want.fill(0, n) else wrong).append(n)
    return hits, misses, wrong


def beat(pool: SharedPool) -> QuotaStep:
    assert pool.own is not None and pool.own.lease is not None and pool.quota is not None
    pool.refresh(force=True)
    pool.own.lease.beat()
    assert pool.quota.last is not None
    return pool.quota.last


def files_of(root: Path, wid: str) -> list[Path]:
    return sorted(p for p in root.rglob(f"w-{wid}*") if p.name == f"w-{wid}")


def test_a_dead_writer_of_another_host_is_retired_when_the_pool_needs_its_bytes(tmp_path):
    cb, cap = Clock(), 20
    cfg_b = cluster_config(tmp_path, "hostb", cap, quota_high=0.85, quota_low=0.8)
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta", cap, quota_high=0.85, quota_low=0.8), NS) as a:
        wid = a.wid
        assert wid is not None and put(a, list(range(12))) == [True] * 12
        beat(a)
        a_dir = a.ns_meta / f"w-{wid}"
        with SharedPool.open_writer(cfg_b, NS, clock=cb) as b:
            n = 100
            for advance in (0.0, DEAD_S - 1):  # over quota_high each time, a not (yet) dead: a stays
                cb.t += advance
                put(b, [n, n + 1])
                n += 2
                step = beat(b)
                assert step.retired == {} and a_dir.exists()
                assert b.verdict(wid).verdict is Verdict.LIVE
            assert read(b, list(range(12))) == (list(range(12)), [], [])
            cb.t += 1
            put(b, [n, n + 1])
            step = beat(b)  # a is dead and the pool needs room: dead bytes go first, so a is retired
            assert step.retired == {wid: 12 * a.slot_bytes} and step.evicted_pages == 0
            assert files_of(tmp_path, wid) == []  # its directory and every file in it are gone
            b.refresh(force=True)
            assert wid not in b.peers() and b.sharing_stats()["peers_dropped"] == 1
            assert b.sharing_stats()["writers_retired"] == 1
            hits, misses, wrong = read(b, list(range(12)))
            assert hits == [] and wrong == [] and misses == list(range(12))
            assert [u.wid for u in beat(b).usages] == [b.wid]  # it counts nothing any more
            assert read(b, list(range(100, n + 2)))[2] == []


def test_a_writer_dead_for_reclaim_after_s_is_retired_without_quota_pressure(tmp_path):
    cb = Clock()
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), NS) as a, \
            SharedPool.open_writer(cluster_config(tmp_path, "hostb"), NS, clock=cb) as b, \
            SharedPool.open_reader(cluster_config(tmp_path, "hostc"), NS) as c:
        wid = a.wid
        assert wid is not None and put(a, list(range(8))) == [True] * 8
        beat(a)
        beat(b)
        c.refresh(force=True)
        assert read(c, list(range(8))) == (list(range(8)), [], [])
        cb.t += DEAD_S
        step = beat(b)
        assert step.retired == {} and step.plan is not None and step.plan.evict_bytes == 0
        assert [u.live for u in step.usages if u.wid == wid] == [False]  # dead: counted, not live
        cb.t += RECLAIM_S - DEAD_S
        assert beat(b).retired == {wid: 8 * a.slot_bytes}
        assert files_of(tmp_path, wid) == []
        c.refresh(force=True)  # a reader pool drops the retired writer: its pages are misses
        assert wid not in c.peers() and c.sharing_stats()["peers_dropped"] == 1
        assert read(c, list(range(8))) == ([], list(range(8)), [])


def test_a_retirement_cut_short_is_finished_by_any_live_writer(tmp_path):
    cb = Clock()
    with SharedPool.open_writer(cluster_config(tmp_path, "hostb"), NS, clock=cb) as b:
        dead = SharedPool.open_writer(cluster_config(tmp_path, "hosta"), NS)
        wid = dead.wid
        assert wid is not None and put(dead, list(range(6))) == [True] * 6
        assert dead.own is not None and dead.own.lease is not None
        dead.own.lease.beat()
        lease = read_lease(dead.ns_meta / f"w-{wid}" / "LEASE")
        dead.close()  # "another host": its LOCK means nothing to b
        b.refresh(force=True)
        assert b.peers().keys() == {wid}
        assert lease is not None
        directory = b.ns_meta / f"w-{wid}"
        rt.write_fence(directory, lease["incarnation"], "hostc-0", "hostc")  # a retirer died right after ...
        for seg in directory.glob("seg-*.dat"):
            os.unlink(seg)  # ... deleting the segments
        assert b.verdict(wid).verdict is Verdict.RETIRED
        step = beat(b)  # not dead on b's watch at all: the fence alone says it is going
        assert step.continued == [wid] and step.retired == {} and files_of(tmp_path, wid) == []
        b.refresh(force=True)
        assert b.peers() == {} and read(b, list(range(6))) == ([], list(range(6)), [])


def test_segments_on_every_device_and_the_meta_directory_go(tmp_path):
    devs = [tmp_path / "d0", tmp_path / "d1"]
    for d in devs:
        d.mkdir()
    extra = {"devices": [str(d) for d in devs], "meta_dir": str(tmp_path / "meta")}
    (tmp_path / "meta").mkdir()
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta", **extra), NS) as a:
        wid = a.wid
        assert wid is not None and put(a, list(range(10))) == [True] * 10
        ns_meta = a.ns_meta
        assert a.own is not None
        incarnation = a.own.incarnation
    assert len(files_of(tmp_path, wid)) == 3  # the meta directory and one per device
    done = rt.retire(cluster_config(tmp_path, "hostb", **extra), ns_meta, wid, incarnation, "hostb-0", "hostb")
    assert done.finished and files_of(tmp_path, wid) == []


def test_a_zombie_sees_its_fence_stops_writing_there_and_re_registers(tmp_path):
    cb = Clock()
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), NS) as a, \
            SharedPool.open_writer(cluster_config(tmp_path, "hostb"), NS, clock=cb) as b:
        old_wid = a.wid
        assert old_wid is not None and put(a, list(range(10))) == [True] * 10
        assert put(b, list(range(500, 510))) == [True] * 10
        beat(a)
        beat(b)
        old_dir = a.ns_meta / f"w-{old_wid}"
        # a is "paused": b's clock runs past dead_after_s with a's lease unchanged; a retirer fences it and
        # dies before deleting anything (the deletion is continued later, below)
        cb.t += DEAD_S
        b.refresh(force=True)
        assert b.verdict(old_wid).verdict is Verdict.DEAD
        lease = read_lease(old_dir / "LEASE")
        assert lease is not None
        rt.write_fence(old_dir, lease["incarnation"], "hostc-0", "hostc")
        assert put(a, [100]) == [True]  # a has not beaten yet: a write in the window (lost: a miss)
        assert a.own is not None and a.own.lease is not None
        fenced_store = a.own
        a.own.lease.beat()  # a resumes: its next beat reads its fence
        assert fenced_store.fenced is not None and fenced_store.lease is not None
        assert fenced_store.lease.fenced is not None
        assert fenced_store.put([key(101)], [HostMemory(1, PAGE).runs(0)]) == [False]  # refused, no IO
        assert read(a, list(range(500, 510))) == (list(range(500, 510)), [], [])  # gets go on
        assert put(a, list(range(200, 206))) == [True] * 6  # the next put re-registers first
        assert a.wid is not None and a.wid != old_wid and a.own is not fenced_store
        assert fenced_store._closed  # closed once unused, and with no checkpoint in the fenced directory
        assert not (old_dir / "checkpoint.bin").exists()
        assert a.sharing_stats()["reregistrations"] == 1
        # the new incarnation beats (announcing its journal); its quota step, as any live writer's would,
        # continues the retirement of the fenced directory
        assert beat(a).continued == [old_wid] and files_of(tmp_path, old_wid) == []
        assert beat(b).continued == []
        b.refresh(force=True)
        assert b.verdict(a.wid).verdict is Verdict.LIVE
        assert read(b, list(range(200, 206))) == (list(range(200, 206)), [], [])
        assert read(b, [*range(10), 100]) == ([], [*range(10), 100], [])
        assert read(a, list(range(200, 206)))[0] == list(range(200, 206))
        a.refresh(force=True)
        assert read(a, list(range(500, 510))) == (list(range(500, 510)), [], [])


def test_a_zombie_whose_directory_is_already_gone_re_registers_under_load(tmp_path):
    cb = Clock()
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta", 128), NS) as a, \
            SharedPool.open_writer(cluster_config(tmp_path, "hostb", 128), NS, clock=cb) as b:
        assert put(a, list(range(10))) == [True] * 10 and put(b, list(range(500, 540))) == [True] * 40
        beat(a)
        beat(b)
        a.refresh(force=True)
        cb.t += RECLAIM_S
        old_wid = a.wid
        assert old_wid is not None and beat(b).retired.keys() == {old_wid}  # every file of a is gone
        assert a.own is not None and a.own.lease is not None
        a.own.lease.beat()
        assert a.own.fenced is not None
        wrong: list[int] = []
        stop = threading.Event()

        def reader() -> None:
            while not stop.is_set():
                hits, misses, bad = read(a, list(range(500, 540)))
                wrong.extend(bad)
                assert misses == []

        def writer() -> None:
            try:
                for start in range(1000, 1040, 8):
                    assert put(a, list(range(start, start + 8))) == [True] * 8
            finally:
                stop.set()

        run_concurrently(reader, reader, writer)
        assert wrong == [] and a.sharing_stats()["reregistrations"] == 1
        assert a.wid == old_wid  # its directory was gone: the lowest free k is the same one, made anew
        beat(a)
        b.refresh(force=True)  # b sees a directory made anew under the same wid and reads it from the start
        assert read(b, list(range(1000, 1040))) == (list(range(1000, 1040)), [], [])


def test_a_directory_found_fenced_at_open_is_never_written(tmp_path):
    cfg_a = cluster_config(tmp_path, "hosta")
    first = SharedPool.open_writer(cfg_a, NS)
    wid = first.wid
    assert wid is not None and put(first, list(range(4))) == [True] * 4
    first.close()  # a retirer of another host fences it, and is still deleting when this host restarts
    directory = first.ns_meta / f"w-{wid}"
    lease = read_lease(directory / "LEASE")
    assert lease is not None
    rt.write_fence(directory, lease["incarnation"], "hostb-0", "hostb")
    with SharedPool.open_writer(cfg_a, NS) as again:
        assert again.wid is not None and again.wid != wid  # the claim saw the fence and moved on
        assert again.sharing_stats()["reregistrations"] == 0  # (``writers`` skips a fenced directory)
        assert put(again, [10]) == [True]
        assert again.verdict(wid).verdict is Verdict.RETIRED  # fenced anew under the incarnation that opened it
        assert beat(again).continued == [wid] and files_of(tmp_path, wid) == []
        assert read(again, [*range(4), 10]) == ([10], list(range(4)), [])


def test_a_writer_whose_directory_was_retired_between_its_claim_and_its_fence_check_moves_on(tmp_path):
    """A retirement that ran between a claim and the claimant's first fence check deleted the directory's files,
    its LOCK too, and then its FENCE, before the claimant made its own: the end state is a live writer holding
    an unlinked LOCK. Its next beat must fence it (else a second process could claim the same directory), and
    its next write re-registers under a LOCK of its own; no page is served wrong."""
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), NS) as a:
        assert put(a, list(range(4))) == [True] * 4
        old_wid = a.wid
        assert old_wid is not None and a.own is not None and a.own.lease is not None
        directory = a.ns_meta / f"w-{old_wid}"
        (directory / "LOCK").unlink()  # what the retirer's deletion left (the claimant's fresh FENCE stands)
        a.own.lease.beat()
        assert a.own.fenced == "its LOCK was deleted (retired)"
        assert put(a, [10]) == [True]  # re-registered: a new directory with a LOCK of its own
        assert a.sharing_stats()["reregistrations"] == 1
        held = a.own.claim  # a LOCK that is linked, held by this writer alone
        assert held.lock_fd is not None and os.stat(held.path / "LOCK").st_ino == os.fstat(held.lock_fd).st_ino
        hits, misses, wrong = read(a, [*range(4), 10])
        assert wrong == [] and 10 in hits


def test_host_mode_never_retires_another_hosts_writer(tmp_path):
    cb, cap = Clock(), 20
    knobs = {"sharing": "host", "quota_high": 0.5, "quota_low": 0.4}
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta", cap, **knobs), NS) as a, \
            SharedPool.open_writer(cluster_config(tmp_path, "hostb", cap, **knobs), NS, clock=cb) as b:
        wid = a.wid
        assert wid is not None and put(a, list(range(12))) == [True] * 12
        beat(a)
        beat(b)
        cb.t += 10 * RECLAIM_S
        step = beat(b)
        assert [u.live for u in step.usages if u.wid == wid] == [False]  # dead on the plan
        assert step.retired == {} and step.continued == [] and (a.ns_meta / f"w-{wid}").exists()
        b.refresh(force=True)
        assert a.own is not None and wid in b.peers()
        kept = [n for n in range(12) if a.own.contains(key(n))]  # a's own quota step kept these
        assert kept and read(b, kept) == (kept, [], [])  # never fenced, still read


# ---------------------------------------------------------------------- a real writer process, other boot
def worker_config() -> dict:
    return {"heartbeat_s": 600.0, "host_id": "hosta", "sharing": "cluster", "allow_local_fs": True,
            "dead_after_s": DEAD_S, "reclaim_after_s": RECLAIM_S}


def test_a_sigstopped_writer_process_is_retired_and_re_registers_when_it_resumes(tmp_path, hostproc):
    cb = Clock()
    proc = hostproc("boot-of-hosta")
    wid = opened(proc, tmp_path, capacity_pages=64, **worker_config())["wid"]
    assert proc.call("put", keys=list(range(16)))["ok"] == [True] * 16
    proc.call("beat")
    with SharedPool.open_writer(cluster_config(tmp_path, "hostb"), NS, clock=cb) as b:
        assert read(b, list(range(16))) == (list(range(16)), [], [])
        proc.p.send_signal(signal.SIGSTOP)
        try:
            cb.t += RECLAIM_S
            assert beat(b).retired.keys() == {wid} and files_of(tmp_path, wid) == []
        finally:
            proc.p.send_signal(signal.SIGCONT)
        b.refresh(force=True)
        assert read(b, list(range(16))) == ([], list(range(16)), [])
        proc.call("beat")  # it finds its fence
        assert proc.call("put", keys=list(range(300, 316)))["ok"] == [True] * 16  # in a fresh directory
        assert proc.call("stats")["own_keys"] == list(range(300, 316))
        proc.call("beat")  # its new lease announces them
        b.refresh(force=True)
        assert read(b, list(range(300, 316))) == (list(range(300, 316)), [], [])
        seen = proc.call("get", keys=list(range(300, 316)))
        assert seen["wrong"] == [] and seen["misses"] == []
        proc.call("close")
        proc.stop()


def test_a_sigkilled_writer_process_of_another_host_is_retired_after_reclaim_after_s(tmp_path, hostproc):
    cb = Clock()
    proc = hostproc("boot-of-hosta")
    wid = opened(proc, tmp_path, capacity_pages=64, **worker_config())["wid"]
    assert proc.call("put", keys=list(range(16)))["ok"] == [True] * 16
    proc.call("beat")
    with SharedPool.open_writer(cluster_config(tmp_path, "hostb"), NS, clock=cb) as b:
        proc.kill()
        assert read(b, list(range(16))) == (list(range(16)), [], [])  # a killed writer's pages stay readable
        cb.t += RECLAIM_S - 1
        assert beat(b).retired == {} and read(b, [0])[0] == [0]
        cb.t += 1
        assert beat(b).retired.keys() == {wid} and files_of(tmp_path, wid) == []
        b.refresh(force=True)
        assert read(b, list(range(16))) == ([], list(range(16)), [])
