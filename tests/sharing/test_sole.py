"""``sharing = "off"``: the namespace shard's one writer, served as a plain shard (``sharing.sole``,
``sharing.sites.SoleSite``, ``sharing.views.open_view``), and kept apart from shared writers.

Every page read is checked byte for byte. Lease threads of shared writers stay idle (``heartbeat_s`` = 600):
a test beats them itself. No sleeps.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import HostMemory, key, kvtier_threads, namespace, store_config
from test_liveness import DEAD_S, RECLAIM_S, Clock, cluster_config
from test_retire import beat, put, read

from sgl_kvtier.errors import ConfigError, DeviceError, KVTierError, StoreLockedError
from sgl_kvtier.sharing.lease import THREAD_NAME, read_lease
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.sharing.sites import DirectorySite, SoleSite, site_for
from sgl_kvtier.sharing.sole import SoleShard
from sgl_kvtier.sharing.views import PoolView, open_view
from sgl_kvtier.sharing.writers import SharingModeError
from sgl_kvtier.store.meta import LEASE

PAGE = 16 * 1024 - 4096  # a 16 KiB slot with its trailer
NS = namespace(PAGE)


def off(path: Path, host: str = "h", **extra):
    return store_config(path, 64, PAGE, sharing="off", host_id=host, follow_interval_s=0.0, **extra)


def shared(path: Path, host: str = "h", **extra):
    return store_config(path, 64, PAGE, host_id=host, heartbeat_s=600.0, follow_interval_s=0.0, **extra)


def lease_threads(threads: set) -> set:
    return {t for t in threads if t.name == THREAD_NAME}


def leases_under(root: Path) -> list[Path]:
    return sorted(root.rglob(LEASE))


def tree_of(root: Path, name: str) -> list[tuple[str, int]]:
    """Every file under the directories called ``name`` (meta and segments), with its size."""
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*")
                  if name in p.parts and p.is_file())


def test_the_site_is_chosen_from_the_mode():
    assert type(site_for(off(Path("/x")))) is SoleSite
    assert type(site_for(shared(Path("/x")))) is DirectorySite


def test_off_opens_one_plain_shard_with_no_lease_thread_and_no_lease(tmp_path):
    before = kvtier_threads()
    view: PoolView = open_view(off(tmp_path), NS, writer=True)
    with view:
        assert isinstance(view, SoleShard) and not isinstance(view, SharedPool)
        own = view.own
        assert own is not None and own.lease is None and own.wid == "h-0"
        assert lease_threads(kvtier_threads() - before) == set()
        mem = HostMemory(1, PAGE)
        mem.fill(0, 1)
        assert view.put([key(1)], [mem.runs(0)]) == [True]
        assert leases_under(tmp_path) == []  # nothing announces it but its LOCK
        assert view.peers() == {} and view.leases() == {} and set(view.sharing_stats().values()) == {0}
        assert own.peer_bytes() == 0 and own.grow_limit_bytes is None  # its own capacity alone
        assert view.refresh(force=True) is False  # nothing to follow
    # The same under "host": a lease thread and a LEASE, which the checks above would have caught.
    (tmp_path / "other").mkdir()
    with open_view(shared(tmp_path / "other"), NS, writer=True) as pool:
        assert isinstance(pool, SharedPool) and lease_threads(kvtier_threads() - before)
        assert leases_under(tmp_path / "other")
    assert lease_threads(kvtier_threads() - before) == set()


def test_pages_put_are_served_byte_exact_after_a_restart(tmp_path):
    numbers = list(range(10))
    with SoleShard.open_writer(off(tmp_path), NS) as view:
        assert put(view, numbers) == [True] * 10
    with SoleShard.open_writer(off(tmp_path), NS) as view:
        assert view.own is not None and view.own.wid == "h-0"  # its own directory again, warm
        assert view.longest_prefix([key(n) for n in numbers]) == 10
        assert read(view, numbers) == (numbers, [], [])
        assert len(view) == 10 and view.stats().pages == 10


def test_a_second_off_writer_fails_naming_the_holder(tmp_path):
    with open_view(off(tmp_path), NS, writer=True):
        with pytest.raises(StoreLockedError, match=f"already open for writing by pid {os.getpid()}.*sharing = \"off\""):
            open_view(off(tmp_path), NS, writer=True)
    open_view(off(tmp_path), NS, writer=True).close()  # free again once the holder closed


def test_a_reader_follows_the_one_writer(tmp_path):
    with pytest.raises(DeviceError, match="no store here"):
        open_view(off(tmp_path), NS, writer=False)
    with open_view(off(tmp_path), NS, writer=True) as writer:
        assert put(writer, [1, 2]) == [True, True]
        with open_view(off(tmp_path), NS, writer=False) as reader:
            assert isinstance(reader, SoleShard) and reader.own is None and not reader.writer
            assert read(reader, [1, 2]) == ([1, 2], [], [])
            assert put(writer, [3]) == [True]
            assert reader.longest_prefix([key(1), key(2), key(3)]) == 3  # a shortfall re-reads the journal
            assert read(reader, [3]) == ([3], [], [])
            with pytest.raises(KVTierError, match="read-only"):
                reader.put([key(4)], [HostMemory(1, PAGE).runs(0)])
            assert leases_under(tmp_path) == []


@pytest.mark.parametrize("first", ["off", "host"])
def test_a_live_writer_of_the_other_kind_of_mode_refuses_the_open(tmp_path, first):
    """One sole and one shared writer never run at once in a namespace, whichever starts first."""
    configs = {"off": off(tmp_path), "host": shared(tmp_path, host="g")}  # (under one host_id: the LOCK refuses)
    second = "host" if first == "off" else "off"
    with open_view(configs[first], NS, writer=True):
        with pytest.raises(SharingModeError, match=f"^sharing: .*pid {os.getpid()}") as caught:
            open_view(configs[second], NS, writer=True)
        assert isinstance(caught.value, ConfigError) and isinstance(caught.value, StoreLockedError)
        assert 'sharing = "off"' in str(caught.value)
    open_view(configs[second], NS, writer=True).close()  # once the first closed


def test_an_off_writer_drops_a_lease_left_by_an_earlier_shared_run(tmp_path):
    with open_view(shared(tmp_path), NS, writer=True) as pool:
        assert pool.own is not None
        leased = pool.own.claim.path
    assert read_lease(leased / LEASE) is not None
    with SoleShard.open_writer(off(tmp_path), NS) as view:
        assert view.own is not None and view.own.claim.path == leased
        assert not (leased / LEASE).exists()


@pytest.mark.parametrize("mode", ["host", "cluster"])
def test_no_shared_writer_reclaims_or_retires_an_off_writers_files(tmp_path, mode):
    """An off writer (host "ha") in a directory an earlier shared run leased, gone; a shared writer of
    another host_id whose quota needs bytes, long after every dead and reclaim limit: it reads the off
    writer's pages but never reclaims nor retires them (a writer with no lease is nobody's to take)."""
    cap = 20
    with SharedPool.open_writer(cluster_config(tmp_path, "ha", cap, sharing=mode), NS) as earlier:
        assert put(earlier, [0]) == [True]
        beat(earlier)
    with SoleShard.open_writer(cluster_config(tmp_path, "ha", cap, sharing="off"), NS) as view:
        assert view.own is not None
        off_dir = view.own.claim.path
        assert put(view, list(range(12))) == [True] * 12
    files = tree_of(tmp_path, "w-ha-0")
    clock = Clock()
    cfg = cluster_config(tmp_path, "hb", cap, sharing=mode, quota_high=0.85, quota_low=0.8)
    with SharedPool.open_writer(cfg, NS, clock=clock) as other:
        assert read(other, list(range(12)))[0] == list(range(12))  # followed: its pages are readable
        for n in range(100, 110, 2):
            clock.t += max(DEAD_S, RECLAIM_S)
            put(other, [n, n + 1])
            step = beat(other)
            assert step.retired == {} and step.reclaimed == {} and step.continued == []
    assert off_dir.is_dir()
    assert tree_of(tmp_path, "w-ha-0") == files
    with SoleShard.open_writer(cluster_config(tmp_path, "ha", cap, sharing="off"), NS) as view:
        assert read(view, list(range(12))) == (list(range(12)), [], [])
