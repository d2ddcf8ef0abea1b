"""One pool quota kept by every writer, no coordinator (``sharing.quota_loop``): injected clocks, direct beats.

Each writer's lease thread is kept idle (``heartbeat_s`` = 600: it beats once at open); a test beats a
writer itself (``Lease.beat``, which runs that writer's quota step) and moves a shared fake clock. Nothing
sleeps: behaviour is checked, not speed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from support import HostMemory, key, namespace, store_config
from test_sharing import PAGE, opened, procs  # noqa: F401 - procs is a fixture

from sgl_kvtier.errors import ConfigError
from sgl_kvtier.sharing.lease import read_lease
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.sharing.quota_loop import QuotaStep
from sgl_kvtier.sharing.writers import host_id, writer_alive, writer_dirs
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import holes
from sgl_kvtier.store import journal as jr


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def config(path: Path, capacity_pages: int, **extra: Any):
    return store_config(path, capacity_pages, PAGE, heartbeat_s=600.0, follow_interval_s=0.0, **extra)


def put_chain(pool: SharedPool, numbers: list[int], chained: bool = True) -> list[bool]:
    mem = HostMemory(1, PAGE)
    out: list[bool] = []
    for i, n in enumerate(numbers):
        mem.fill(0, n)
        parent = key(numbers[i - 1]) if chained and i else None
        out += pool.put([key(n)], [mem.runs(0)], parent)
    return out


def beat(pool: SharedPool) -> QuotaStep:
    assert pool.own is not None and pool.own.lease is not None and pool.quota is not None
    pool.refresh(force=True)
    pool.own.lease.beat()  # publishes bytes_used and age_hist, then runs the quota step on them
    assert pool.quota.last is not None
    return pool.quota.last


def leased_pages(ns_meta: Path) -> int:
    total = 0
    for _, path in writer_dirs(ns_meta):
        lease = read_lease(path / "LEASE")
        total += 0 if lease is None else int(lease["pages"])
    return total


def dir_pages(ns_meta: Path) -> int:
    return sum(len(jr.recover(path).slot_of) for _, path in writer_dirs(ns_meta))


def own_numbers(pool: SharedPool) -> set[int]:
    assert pool.own is not None
    return {int.from_bytes(k[:4], "little") for k in pool.own.keys()}


def segment_blocks(pool: SharedPool) -> int:
    assert pool.own is not None
    return sum(p.stat().st_blocks for p in pool.own.layout.meta.glob("seg-*.dat"))


def test_three_writers_keep_the_pool_under_its_capacity_evicting_chain_aware(tmp_path):
    clock, cap = Clock(), 30
    cfg = config(tmp_path, cap)
    ns = namespace(PAGE)
    with SharedPool.open_writer(cfg, ns, clock=clock) as a, SharedPool.open_writer(cfg, ns, clock=clock) as b, \
            SharedPool.open_writer(cfg, ns, clock=clock) as c:
        pools = [a, b, c]
        for i, pool in enumerate(pools):
            assert put_chain(pool, list(range(100 * i, 100 * i + 10))) == [True] * 10
            clock.t += 100.0  # a's pages end up the oldest, then b's
        ns_meta = a.ns_meta
        assert dir_pages(ns_meta) == 30  # at the cap, past quota_high (the leases still say 0: not beaten)
        blocks = segment_blocks(a)
        evicted = {}
        for _ in range(3):  # rounds of beats; the leases agree from the second on
            for pool in pools:
                step = beat(pool)
                evicted[pool.wid] = evicted.get(pool.wid, 0) + step.evicted_pages
                if step.evicted_pages:
                    punched = step.punched_bytes
                assert leased_pages(ns_meta) <= cap and dir_pages(ns_meta) <= cap
        assert evicted == {a.wid: 3, b.wid: 0, c.wid: 0}  # only the oldest pages' owner gave
        assert leased_pages(ns_meta) == dir_pages(ns_meta) == 27 <= cfg.quota_low * cap
        # Chain-aware: the deepest pages of a's chain went; every remaining page's ancestors remain.
        assert own_numbers(a) == set(range(7))
        assert own_numbers(b) == set(range(100, 110)) and own_numbers(c) == set(range(200, 210))
        if holes.supported() and punched:
            assert punched == 3 * a.slot_bytes and segment_blocks(a) < blocks


def test_holes_are_punched_over_slots_the_quota_frees(tmp_path):
    if not holes.supported():
        pytest.skip(f"no fallocate on {sys.platform}")
    clock = Clock()
    with SharedPool.open_writer(config(tmp_path, 16, quota_low=0.5), namespace(PAGE), clock=clock) as a:
        assert put_chain(a, list(range(16))) == [True] * 16
        os.sync()
        before = segment_blocks(a)
        clock.t += 100.0
        step = beat(a)
        assert step.evicted_pages == 8
        if step.punched_bytes == 0:
            pytest.skip("this filesystem does not punch holes")
        assert step.punched_bytes == 8 * a.slot_bytes and segment_blocks(a) < before
        assert put_chain(a, [1000, 1001]) == [True, True]  # a punched slot takes a page again
        mem = HostMemory(1, PAGE)
        assert a.get([key(1000)], [mem.runs(0)]) == [True] and mem.page(0).tobytes() == mem.fill(0, 1000)


def test_a_late_writer_gets_room_up_to_its_min_share(tmp_path):
    clock, cap, floor = Clock(), 20, 4
    ns = namespace(PAGE)
    cfg = config(tmp_path, cap, min_share_bytes=floor * fmt.slot_bytes_for(PAGE, parts=1))
    with SharedPool.open_writer(cfg, ns, clock=clock) as a, SharedPool.open_writer(cfg, ns, clock=clock) as b:
        assert put_chain(a, list(range(10)), chained=False) == [True] * 10
        beat(a)
        assert put_chain(b, list(range(100, 110)), chained=False) == [True] * 10
        beat(b)
        beat(a)
        with SharedPool.open_writer(cfg, ns, clock=clock) as c:
            assert put_chain(c, [200]) == [False]  # the pool is full: c has nothing of its own to evict
            n = 200
            for _ in range(6):
                clock.t += 100.0  # what a and b hold ages; c's pages are always the youngest
                for pool in (a, b, c):
                    beat(pool)
                    assert leased_pages(a.ns_meta) <= cap and dir_pages(a.ns_meta) <= cap
                put_chain(c, [n, n + 1], chained=False)  # at its limit c replaces its own pages
                n += 2
                for pool in (a, b, c):
                    beat(pool)
                assert dir_pages(a.ns_meta) <= cap and leased_pages(a.ns_meta) <= cap
            assert len(c.own or ()) >= floor  # the newcomer got its min share; the others shrank for it
            assert len(a.own or ()) < 10 and len(b.own or ()) < 10


def test_a_page_another_writer_keeps_reading_stays_warm(tmp_path):
    clock = Clock()
    ns = namespace(PAGE)
    cfg = config(tmp_path, 10, eviction="lru", quota_low=0.1)
    with SharedPool.open_writer(cfg, ns, clock=clock) as a, SharedPool.open_writer(cfg, ns, clock=clock) as b:
        assert put_chain(a, list(range(10)), chained=False) == [True] * 10  # page 0 is a's coldest
        clock.t += 500.0
        mem = HostMemory(1, PAGE)
        assert b.get([key(0)], [mem.runs(0)]) == [True]  # b reads a's page: a TOUCH in b's journal
        a.refresh(force=True)  # a takes b's TOUCH: page 0 used now on a's clock
        assert a.own is not None and a.own._index.last_used(key(0)) == clock.t
        step = beat(a)
        assert step.evicted_pages == 9
        assert own_numbers(a) == {0}  # the page b reads survived; a's unread pages of the same age went


def test_a_sigkilled_writers_space_is_reclaimed_when_the_pool_needs_it(tmp_path, procs):  # noqa: F811
    clock = Clock()
    cfg = config(tmp_path, 20)
    with SharedPool.open_writer(cfg, namespace(PAGE), clock=clock) as b:  # first: the lowest k is b's
        (dead,) = procs(1)
        wid = opened(dead, tmp_path, capacity_pages=20, heartbeat_s=600.0)["wid"]
        assert dead.call("put", keys=list(range(12)))["ok"] == [True] * 12
        dead.call("beat")
        dead.kill()
        dead_dir = b.ns_meta / f"w-{wid}"
        assert writer_alive(dead_dir, read_lease(dead_dir / "LEASE"), host_id(cfg)) is False
        mem = HostMemory(1, PAGE)
        for n in range(12):  # a SIGKILLed writer's pages stay readable
            assert b.get([key(n)], [mem.runs(0)]) == [True] and mem.page(0).tobytes() == mem.fill(0, n)
        assert put_chain(b, list(range(100, 104))) == [True] * 4
        assert beat(b).reclaimed == {}  # 16 of 20: the pool does not need the space yet
        assert put_chain(b, list(range(104, 108))) == [True] * 4
        step = beat(b)  # 20 of 20: past quota_high; dead bytes go first
        assert step.reclaimed == {wid: 2} and step.evicted_pages == 0
        lease = read_lease(dead_dir / "LEASE")
        assert lease is not None and lease["pages"] == 10  # its bytes dropped, as its lease says
        assert writer_alive(dead_dir, lease, host_id(cfg)) is False  # the reclaimer let the lock go
        b.refresh(force=True)
        hits = [n for n in range(12) if b.get([key(n)], [mem.runs(0)]) == [True]]
        assert len(hits) == 10  # what is left stays readable to everyone
        (again,) = procs(1)
        assert opened(again, tmp_path, capacity_pages=20, heartbeat_s=600.0)["wid"] == wid  # its own dir
        assert again.call("stats")["own_keys"] == hits  # warm: what the reclaim left


@pytest.mark.parametrize(("field", "value"), [("quota_high", 1.5), ("quota_high", 0.0), ("quota_low", 0.99),
                                              ("min_share_bytes", -1)])
def test_quota_settings_are_checked_naming_the_field(tmp_path, field, value):
    with pytest.raises(ConfigError, match=field):
        config(tmp_path, 16, **{field: value})


def test_the_pool_and_its_quota_judge_other_hosts_with_one_watch(tmp_path):
    from test_liveness import DEAD_S, cluster_config

    clock = Clock()
    ns = namespace(PAGE)
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), ns) as a, \
            SharedPool.open_writer(cluster_config(tmp_path, "hostb"), ns, clock=clock) as b:
        assert b.quota is not None and b.quota.watch is b._watch  # one verdict per writer, whoever asks
        assert put_chain(a, list(range(4))) == [True] * 4
        beat(a)
        (usage,) = [u for u in beat(b).usages if u.wid == a.wid]
        assert usage.live and usage.seen_age_s == 0.0
        clock.t += DEAD_S
        (usage,) = [u for u in beat(b).usages if u.wid == a.wid]
        assert not usage.live and usage.seen_age_s == DEAD_S and b.peer_alive(str(a.wid)) is False


def test_a_retired_writer_counts_nothing_in_the_plan(tmp_path):
    from test_liveness import cluster_config

    from sgl_kvtier.sharing.retire import write_fence

    ns = namespace(PAGE)
    with SharedPool.open_writer(cluster_config(tmp_path, "hostb"), ns, clock=Clock()) as b:
        a = SharedPool.open_writer(cluster_config(tmp_path, "hosta"), ns)
        assert a.own is not None and put_chain(a, list(range(4))) == [True] * 4
        beat(a)
        assert {u.wid for u in beat(b).usages} == {a.wid, b.wid}
        write_fence(a.own.layout.meta, a.own.incarnation, "hostc-0", "hostc")
        step = beat(b)
        assert {u.wid for u in step.usages} == {b.wid} and step.continued == [a.wid]
        a.close()  # the zombie closes (its fence seen at close: no checkpoint into the deleted directory)
        assert writer_dirs(b.ns_meta) == [(b.wid, b.ns_meta / f"w-{b.wid}")]
