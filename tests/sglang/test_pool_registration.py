"""Every pool SGLang registers is served or refused loudly, and all of a backend's pools share one capacity.

Real SGLang host pools on the CPU (``pools.py``), registered the way ``HybridCacheController`` does it:
``register_mem_pool_host(kv)``, then ``register_mem_host_pool_v2`` for every ``HostPoolGroup`` entry (the KV
pool among them, as ``"kv"``), then ``on_host_pools_registered()``; a draft sidecar may arrive later.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("sglang")

from pools import fill_random, mha_host_pool, page_bytes, storage_config, zero  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool  # noqa: E402
from support import kvtier_threads, lock_free_elsewhere, open_fds_under  # noqa: E402
from test_storage_adapter import PS, chain_keys, slots  # noqa: E402

from sgl_kvtier.errors import ConfigError, KVTierError  # noqa: E402
from sgl_kvtier.media.shared_raw.superblock import format_pool, superblock_of  # noqa: E402
from sgl_kvtier.sglang import KVTierStorage  # noqa: E402
from sgl_kvtier.sglang import capacity as capacity_module  # noqa: E402
from sgl_kvtier.sglang.capacity import slot_bytes  # noqa: E402
from sgl_kvtier.sglang.host_shards import UnservedPoolError  # noqa: E402
from sgl_kvtier.store.format import BLOCK_HEADER_BYTES  # noqa: E402

LIMIT = 64 << 20


def new_backend(devices, **extra) -> KVTierStorage:
    cfg = {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang", "class_name": "KVTierStorage",
           "interface_v1": 1, "devices": [str(d) for d in devices], "capacity_bytes": LIMIT, **extra}
    return KVTierStorage(storage_config({k: v for k, v in cfg.items() if v is not None}), {})


def register(backend, kv, **side) -> None:
    """SGLang's order: the anchor, then every entry of the group (KV included), then the end of it."""
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    for name, pool in side.items():
        backend.register_mem_host_pool_v2(pool, PoolName(name))
    backend.on_host_pools_registered()


def capacities(backend) -> dict[str, int]:
    return {name: t.store.stats().capacity_bytes for name, t in backend.shards.items()}


def side_pools():
    """Two side pools of other geometries than the KV pool (standing in for SWA and draft-KV pools)."""
    return {"swa": mha_host_pool("page_first", layers=1), "draft": mha_host_pool("layer_first", heads=1)}


# ---------------------------------------------------------------------- served or refused
def test_the_kv_pool_registered_again_through_v2_is_the_kv_tier(tmp_path):
    kv = mha_host_pool("page_first")
    fill_random(kv, seed=31)
    backend = new_backend([tmp_path])
    register(backend, kv)
    assert set(backend.shards) == {"kv"} and backend.shards["kv"].pages.pool is kv
    keys = chain_keys(3)
    assert backend.batch_set_v1(keys, slots([1, 2, 3])) == [True] * 3
    assert backend.batch_exists(keys) == 3
    backend.close()


def assert_nothing_held(root, backend, metas, threads_before) -> None:
    assert open_fds_under(root) == {}
    assert kvtier_threads() - threads_before == set()
    assert all(lock_free_elsewhere(meta) for meta in metas)
    assert backend.shards == {} and backend.kv is None


@pytest.mark.parametrize("when", ["at start-up", "late"])
def test_another_pool_under_the_kv_name_is_refused_and_the_backend_lets_go(tmp_path, when):
    kv, other = mha_host_pool("page_first"), mha_host_pool("page_first")
    fill_random(kv, seed=32)
    threads_before = kvtier_threads()
    backend = new_backend([tmp_path])
    backend.register_mem_pool_host(kv)
    keys = chain_keys(4)
    assert backend.batch_set_v1(keys, slots([0, 1, 2, 3])) == [True] * 4
    metas = [backend.kv.store.layout.meta]
    if when == "late":
        backend.on_host_pools_registered()
    with pytest.raises(UnservedPoolError, match=r"host pool 'kv' \(MHATokenToKVPoolHost\) is not served: another"):
        backend.register_mem_host_pool_v2(other, PoolName.KV)
    assert_nothing_held(tmp_path, backend, metas, threads_before)  # the attach failed: nothing kept open
    with pytest.raises(KVTierError, match="not serving: host pool 'kv'"):
        backend.on_host_pools_registered()
    assert backend.batch_exists(keys) == 0  # a miss, never a crash
    assert backend.boundary.counts().expected == 1
    backend.close()

    again = new_backend([tmp_path])  # the next attach serves what was stored
    register(again, kv)
    assert again.batch_exists(keys) == 4
    again.close()


def test_a_pool_whose_pages_cannot_be_described_is_refused_naming_it(tmp_path):
    """SGLang's own LogicalHostPool (DeepSeek-V4's index-only anchor: no KV tensor) as a side pool and as
    the KV pool: refused at registration, with the pool's name, not ignored."""
    logical = LogicalHostPool(1024, PS)
    backend = new_backend([tmp_path])
    backend.register_mem_pool_host(mha_host_pool("page_first"))
    with pytest.raises(UnservedPoolError, match=r"host pool 'indexer' \(LogicalHostPool\) is not served: its pages"):
        backend.register_mem_host_pool_v2(logical, PoolName.INDEXER)
    backend.close()
    with pytest.raises(UnservedPoolError, match=r"host pool 'kv' \(LogicalHostPool\)"):
        new_backend([tmp_path]).register_mem_pool_host(logical)
    assert open_fds_under(tmp_path) == {}


# ---------------------------------------------------------------------- one capacity per backend
@pytest.mark.parametrize("ndev", [1, 2])
def test_side_pools_share_the_configured_capacity(tmp_path, ndev):
    devices = [tmp_path / f"d{i}" for i in range(ndev)]
    for d in devices:
        d.mkdir()
    kv, side = mha_host_pool("page_first"), side_pools()
    backend = new_backend(devices)
    register(backend, kv, **side)
    held = capacities(backend)
    assert set(held) == {"kv", "swa", "draft"}
    slot = {name: slot_bytes(t.namespace) for name, t in backend.shards.items()}
    pages = LIMIT // (ndev * sum(slot.values()))  # per device: as many pages of every pool
    assert held == {name: pages * ndev * s for name, s in slot.items()}
    assert LIMIT - ndev * sum(slot.values()) < sum(held.values()) <= LIMIT
    backend.close()


def test_the_free_space_default_is_one_limit_for_all_pools(tmp_path, monkeypatch):
    """Without capacity_bytes, 90 % of the device's free space is the limit of the backend, not of each pool.
    (The filesystem's report is pinned so the limit is exact while other processes write to the disk.)"""
    free = 48 << 20

    class PinnedFs:
        def __getattr__(self, name):
            return getattr(os, name)

        def statvfs(self, path):  # what a filesystem of ``free`` bytes reports once the store's files are in it
            real = os.statvfs(path)
            left = free - sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
            return os.statvfs_result((4096, 4096, real.f_blocks, left // 4096, left // 4096, *real[5:]))

    monkeypatch.setattr(capacity_module, "os", PinnedFs())
    backend = new_backend([tmp_path], capacity_bytes=None)
    register(backend, mha_host_pool("page_first"), **side_pools())
    held = capacities(backend)
    limit = int(free * capacity_module.FREE_SPACE_SHARE)
    assert sum(held.values()) <= limit
    assert len({n // slot_bytes(t.namespace) for n, t in zip(held.values(), backend.shards.values())}) == 1
    backend.close()


def test_the_default_on_a_pool_device_is_this_hosts_share_less_the_journal_areas(tmp_path):
    """A device formatted for several hosts: without capacity_bytes the backend's limit comes from this
    host's share (not the device's size), so every pool's region fits in the share and pages round-trip."""
    dev = tmp_path / "pool.img"
    with open(dev, "wb") as f:
        f.truncate(96 << 20)
    format_pool([str(dev)], 2)
    share = superblock_of(str(dev)).share_bytes
    kv = mha_host_pool("page_first")
    fill_random(kv, seed=35)
    backend = new_backend([dev], capacity_bytes=None, sharing="cluster", host_index=1, host_id="hostb",
                          heartbeat_s=600.0, dead_after_s=1800.0, reclaim_after_s=1800.0, checkpoint_interval=1000)
    register(backend, kv, **side_pools())
    held = capacities(backend)
    assert 0 < sum(held.values()) < share
    keys = chain_keys(4)
    expected = [page_bytes(kv, p * PS) for p in range(4)]
    assert backend.batch_set_v1(keys, slots(list(range(4)))) == [True] * 4
    zero(kv)
    assert backend.batch_get_v1(keys, slots(list(range(4)))) == [True] * 4
    assert [page_bytes(kv, p * PS) for p in range(4)] == expected
    backend.close()


def test_a_pool_registered_late_reshares_and_everything_keeps_serving(tmp_path):
    kv, draft = mha_host_pool("page_first"), mha_host_pool("page_first", layers=1)
    fill_random(kv, seed=33)
    fill_random(draft, seed=34)
    backend = new_backend([tmp_path])
    register(backend, kv)
    assert capacities(backend)["kv"] == LIMIT // slot_bytes(backend.kv.namespace) * slot_bytes(backend.kv.namespace)
    keys = chain_keys(6)
    expected = [page_bytes(kv, p * PS) for p in range(6)]
    assert backend.batch_set_v1(keys, slots(list(range(6)))) == [True] * 6
    backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)  # a draft sidecar, after start-up
    held = capacities(backend)
    assert set(held) == {"kv", "draft"} and sum(held.values()) <= LIMIT
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=slots([0, 1]), keys=keys[:2])]) \
        == {"draft": [True, True]}
    zero(kv)
    assert backend.batch_exists(keys) == 6  # the KV pages stored under the old share are still served
    assert backend.batch_get_v1(keys, slots(list(range(10, 16)))) == [True] * 6
    assert [page_bytes(kv, p * PS) for p in range(10, 16)] == expected
    backend.close()


def raw_device(tmp_path, size: int):
    """A regular file standing in for a raw block device (the store accepts one), zeroed, and the meta
    directory a raw first device needs."""
    path, meta = tmp_path / "nvme0n1", tmp_path / "meta"
    with open(path, "wb") as f:
        f.truncate(size)
    meta.mkdir()
    return path, str(meta)


def test_pools_on_a_raw_block_device_share_it(tmp_path):
    """Each pool claims a region of the device: by default they share its size, so the first cannot claim it
    all and leave the next one no room."""
    size = 40 << 20
    device, meta = raw_device(tmp_path, size)
    backend = new_backend([device], capacity_bytes=None, meta_dir=meta)
    register(backend, mha_host_pool("page_first"), **side_pools())
    held = capacities(backend)
    assert set(held) == {"kv", "swa", "draft"}
    assert sum(held.values()) <= size - BLOCK_HEADER_BYTES
    backend.close()

    again = new_backend([device], capacity_bytes=None, meta_dir=meta)  # the same regions, found again
    register(again, mha_host_pool("page_first"), **side_pools())
    assert capacities(again) == held
    again.close()


def test_a_late_pool_on_a_raw_block_device_is_refused_not_over_promised(tmp_path):
    """Regions keep the size of their first claim: a pool arriving after them cannot be given a share."""
    device, meta = raw_device(tmp_path, 40 << 20)
    threads_before = kvtier_threads()
    backend = new_backend([device], capacity_bytes=None, meta_dir=meta)
    register(backend, mha_host_pool("page_first"))
    metas = [backend.kv.store.layout.meta]
    with pytest.raises(KVTierError, match="capacity_bytes|too small"):
        backend.register_mem_host_pool_v2(mha_host_pool("page_first", layers=1), PoolName.DRAFT)
    assert_nothing_held(tmp_path, backend, metas, threads_before)
    backend.close()


def test_a_limit_below_one_page_of_each_pool_is_refused(tmp_path):
    backend = new_backend([tmp_path], capacity_bytes=8192)
    with pytest.raises(ConfigError, match="^capacity_bytes: 8192 bytes cannot hold one page of each pool"):
        register(backend, mha_host_pool("page_first"))
    assert open_fds_under(tmp_path) == {}
