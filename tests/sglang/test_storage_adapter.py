"""KVTierStorage against SGLang's real host pools (CPU, pin_memory=False), driven the way the controller
drives it: 64-hex keys, scattered page-aligned host slots, <=128-page batches, three threads."""

from __future__ import annotations

import hashlib

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from pools import MHA_LAYOUTS, fill_random, mha_host_pool, mla_host_pool, page_bytes, storage_config, zero  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: E402
from support import run_concurrently  # noqa: E402

from sgl_kvtier.errors import ConfigError  # noqa: E402
from sgl_kvtier.sglang import KVTierStorage  # noqa: E402
from sgl_kvtier.telemetry.counters import BoundaryCounts  # noqa: E402

PS = 16


def chain_keys(n: int, seed: str = "s") -> list[str]:
    keys, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        keys.append(prev.hex())
    return keys


def slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PS, (p + 1) * PS, dtype=torch.int64) for p in pages])


def make_backend(tmp_path, pool, mla=False, **extra):
    cfg = {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang", "class_name": "KVTierStorage",
           "interface_v1": 1, "devices": [str(tmp_path)], "capacity_bytes": 64 << 20,
           "readahead_bytes": 64 << 20, **extra}  # read-ahead on (off by default) unless a test says 0
    backend = KVTierStorage(storage_config(cfg, mla=mla), {})
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()  # as SGLang's controller does once every pool is registered
    return backend


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_v1_round_trip_every_mha_layout(tmp_path, layout):
    pool = mha_host_pool(layout)
    fill_random(pool, seed=1)
    backend = make_backend(tmp_path, pool)
    keys = chain_keys(12)
    src = [3, 17, 5, 40, 41, 9, 60, 2, 33, 21, 7, 50]
    expected = [page_bytes(pool, p * PS) for p in src]
    assert backend.batch_set_v1(keys, slots(src)) == [True] * 12
    assert backend.batch_exists(keys + chain_keys(3, "other")) == 12
    zero(pool)
    dst = [70, 1, 88, 4, 90, 12, 99, 30, 31, 80, 6, 100]
    assert backend.batch_get_v1(keys, slots(dst)) == [True] * 12
    assert [page_bytes(pool, p * PS) for p in dst] == expected
    assert backend.kv.readahead.counters.served == 12  # batch_exists started the reads; the get took them
    backend.close()


@pytest.mark.parametrize("readahead_bytes", [0, 3 * 8192])
def test_read_ahead_off_or_smaller_than_the_hit_serves_the_same_bytes(tmp_path, readahead_bytes):
    pool = mha_host_pool("layer_first")  # 2 layers x K,V x 16 tokens x 2 heads x 64 x bf16 = 16 KiB pages
    fill_random(pool, seed=9)
    backend = make_backend(tmp_path, pool, readahead_bytes=readahead_bytes)
    keys = chain_keys(6)
    expected = [page_bytes(pool, p * PS) for p in range(6)]
    assert backend.batch_set_v1(keys, slots(list(range(6)))) == [True] * 6
    assert backend.batch_exists(keys) == 6
    zero(pool)
    assert backend.batch_get_v1(keys, slots(list(range(10, 16)))) == [True] * 6
    assert [page_bytes(pool, p * PS) for p in range(10, 16)] == expected
    ra = backend.kv.readahead
    assert (ra is None) if readahead_bytes == 0 else (ra.counters.served == 1 and ra.buffers_in_use() == 0)
    backend.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_v1_round_trip_mla(tmp_path, layout):
    pool = mla_host_pool(layout)
    fill_random(pool, seed=2)
    backend = make_backend(tmp_path, pool, mla=True)
    keys = chain_keys(5)
    expected = [page_bytes(pool, p * PS) for p in (8, 3, 11, 2, 5)]
    assert backend.batch_set_v1(keys, slots([8, 3, 11, 2, 5])) == [True] * 5
    zero(pool)
    assert backend.batch_get_v1(keys, slots([20, 21, 22, 23, 24])) == [True] * 5
    assert [page_bytes(pool, p * PS) for p in (20, 21, 22, 23, 24)] == expected
    backend.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_legacy_and_v1_paths_store_the_same_bytes(tmp_path, layout):
    pool = mha_host_pool(layout)
    fill_random(pool, seed=3)
    backend = make_backend(tmp_path, pool)
    keys = chain_keys(4)
    assert backend.batch_set_v1(keys[:2], slots([1, 2])) == [True, True]
    flats = [pool.get_data_page(p * PS, flat=True).clone() for p in (3, 4)]
    assert backend.batch_set(keys[2:], flats) is True
    got = backend.batch_get(keys[:2], [pool.get_dummy_flat_data_page() for _ in range(2)])
    assert [g.view(torch.uint8).numpy().tobytes() for g in got] == [page_bytes(pool, p * PS) for p in (1, 2)]
    expected = [page_bytes(pool, p * PS) for p in (3, 4)]
    zero(pool)
    assert backend.batch_get_v1(keys[2:], slots([7, 8])) == [True, True]
    assert [page_bytes(pool, p * PS) for p in (7, 8)] == expected
    assert backend.exists(keys[0]) and not backend.exists(chain_keys(1, "x")[0])
    one = backend.get(keys[3], pool.get_dummy_flat_data_page())
    assert one.view(torch.uint8).numpy().tobytes() == expected[1]
    assert backend.get(chain_keys(1, "x")[0], pool.get_dummy_flat_data_page()) is None
    assert backend.set(chain_keys(1, "y")[0], pool.get_data_page(0, flat=True).clone()) is True
    backend.close()


def test_prefix_semantics_partial_batches_and_misses(tmp_path):
    pool = mha_host_pool("page_first")
    fill_random(pool, seed=4)
    backend = make_backend(tmp_path, pool)
    keys = chain_keys(10)
    backend.batch_set_v1(keys[:4], slots([0, 1, 2, 3]))
    backend.batch_set_v1(keys[6:8], slots([6, 7]))  # a hole at 4..5
    assert backend.batch_exists(keys) == 4
    assert backend.batch_exists(keys[6:]) == 2
    assert backend.batch_exists([]) == 0
    got = backend.batch_get_v1(keys[2:8], slots([20, 21, 22, 23, 24, 25]))
    assert got == [True, True, False, False, False, False]  # only the leading run is read
    assert backend.batch_exists(["not-a-hash"] + keys) == 0
    assert backend.batch_set_v1(keys[:2], slots([0])) == [False, False]  # indices for 1 page, 2 keys
    assert backend.batch_get_v1(keys[:1], torch.arange(3, 3 + PS)) == [False]  # not page aligned
    assert backend.batch_set_v1(["zz"] + keys[8:9], slots([8, 9])) == [False, True]
    assert backend.telemetry().boundary == BoundaryCounts(expected=2, unexpected=0)  # two bad-argument misses
    backend.close()


def test_existing_keys_are_skipped(tmp_path):
    pool = mha_host_pool("page_first")
    fill_random(pool, seed=5)
    backend = make_backend(tmp_path, pool)
    keys = chain_keys(3)
    backend.batch_set_v1(keys, slots([0, 1, 2]))
    before = backend.kv.store.stats().counters["put_pages"]
    assert backend.batch_set_v1(keys, slots([5, 6, 7])) == [True] * 3
    assert backend.kv.store.stats().counters["put_pages"] == before
    backend.close()


def test_namespace_isolation(tmp_path):
    pool = mha_host_pool("page_first")
    fill_random(pool, seed=6)
    a = make_backend(tmp_path, pool)
    keys = chain_keys(4)
    a.batch_set_v1(keys, slots([0, 1, 2, 3]))
    a.close()
    other_model = KVTierStorage(storage_config({"devices": [str(tmp_path)]}, model="another-model"), {})
    other_model.register_mem_pool_host(pool)
    assert other_model.batch_exists(keys) == 0
    other_model.close()
    other_layout = make_backend(tmp_path, mha_host_pool("layer_first"))
    assert other_layout.batch_exists(keys) == 0
    other_layout.close()
    other_rank = KVTierStorage(storage_config({"devices": [str(tmp_path)]}, tp_rank=1, tp_size=2), {})
    other_rank.register_mem_pool_host(pool)
    assert other_rank.batch_exists(keys) == 0
    other_rank.close()
    same = make_backend(tmp_path, pool)
    assert same.batch_exists(keys) == 4
    same.close()


def test_three_threads_like_the_controller(tmp_path):
    pool = mha_host_pool("page_first", tokens=4096)
    fill_random(pool, seed=7)
    backend = make_backend(tmp_path, pool)
    keys = chain_keys(96)
    truth = {k: page_bytes(pool, p * PS) for k, p in zip(keys, range(96))}
    errors = []

    def backup():
        for start in range(0, 96, 16):
            if not all(backend.batch_set_v1(keys[start:start + 16], slots(list(range(start, start + 16))))):
                errors.append("set")

    def prefetch_io():
        for _ in range(30):
            n = backend.batch_exists(keys)
            if n == 0:
                continue
            got = backend.batch_get_v1(keys[:n], slots(list(range(200, 200 + n))))
            for i, ok in enumerate(got):
                if ok and page_bytes(pool, (200 + i) * PS) != truth[keys[i]]:
                    errors.append(i)

    def exists():
        for _ in range(200):
            backend.batch_exists(keys)

    run_concurrently(backup, prefetch_io, exists)
    assert errors == []
    assert backend.batch_exists(keys) == 96
    backend.close()


def test_bad_config_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="^capacity_bytes"):
        KVTierStorage(storage_config({"devices": [str(tmp_path)], "capacity_bytes": "lots"}), {})
    with pytest.raises(ConfigError, match="^devices"):
        KVTierStorage(storage_config({"interface_v1": 1}), {})
    with pytest.raises(ConfigError, match="^durabilty"):
        KVTierStorage(storage_config({"devices": [str(tmp_path)], "durabilty": "batch"}), {})


def test_loaded_through_sglangs_dynamic_factory(tmp_path):
    pool = mha_host_pool("page_first")
    extra = {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang", "class_name": "KVTierStorage",
             "interface_v1": 1, "devices": [str(tmp_path)]}
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    backend.register_mem_pool_host(pool)
    assert type(backend).__name__ in ("KVTierStorage", "HiCacheStorageFailureInjector")
    fill_random(pool, seed=8)
    keys = chain_keys(2)
    assert backend.batch_set_v1(keys, slots([1, 2])) == [True, True]
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics) and stats.backup_pgs == [2] and stats.backup_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []  # drained
    backend.clear()
    assert backend.batch_exists(keys) == 0
    backend.close()


def test_prefix_keys_link_chains_across_batches(tmp_path):
    pool = mha_host_pool("page_first")
    fill_random(pool, seed=9)
    backend = make_backend(tmp_path, pool)
    keys = chain_keys(4)
    backend.batch_set_v1(keys[:2], slots([0, 1]))
    backend.batch_set_v1(keys[2:], slots([2, 3]), HiCacheStorageExtraInfo(prefix_keys=keys[:2]))
    assert backend.kv.store.parent_of(bytes.fromhex(keys[2])) == bytes.fromhex(keys[1])
    backend.close()


def test_an_invalid_key_is_a_page_not_stored_and_does_not_shift_the_chain(tmp_path):
    pool = mha_host_pool("page_first")
    fill_random(pool, seed=9)
    backend = make_backend(tmp_path, pool)
    keys = chain_keys(4)
    assert backend.batch_set_v1([keys[0], "not-a-page-hash", keys[2], keys[3]], slots([0, 1, 2, 3])) == \
        [True, False, True, True]
    store, k = backend.kv.store, [bytes.fromhex(x) for x in keys]
    assert [store.contains(x) for x in k] == [True, False, True, True]
    assert store.parent_of(k[2]) is None  # what precedes it has no key: it chains on nothing, not on keys[0]
    assert store.parent_of(k[3]) == k[2]
    backend.close()


def test_mla_ranks_share_one_shard_written_by_rank_zero(tmp_path):
    extra = {"devices": [str(tmp_path)], "capacity_bytes": 64 << 20, "interface_v1": 1}
    pool0, pool1 = mla_host_pool("page_first"), mla_host_pool("page_first")
    fill_random(pool0, seed=10)
    rank1 = KVTierStorage(storage_config(extra, mla=True, tp_rank=1, tp_size=2), {})
    rank1.register_mem_pool_host(pool1)  # may start before the writer has created the shard
    rank0 = KVTierStorage(storage_config(extra, mla=True, tp_rank=0, tp_size=2), {})
    rank0.register_mem_pool_host(pool0)
    assert rank0.writer and not rank1.writer
    keys = chain_keys(3)
    assert rank1.batch_set_v1(keys, slots([1, 2, 3])) == [True] * 3  # non-writers skip, as SGLang expects
    assert rank1.batch_exists(keys) == 0
    assert rank0.batch_set_v1(keys, slots([1, 2, 3])) == [True] * 3
    rank1.kv._next_open = 0.0  # don't wait out the reader's retry interval in a test
    assert rank1.batch_exists(keys) == 3
    assert rank1.batch_get_v1(keys, slots([7, 8, 9])) == [True] * 3
    assert [page_bytes(pool1, p * PS) for p in (7, 8, 9)] == [page_bytes(pool0, p * PS) for p in (1, 2, 3)]
    rank1.close()
    rank0.close()


def test_v2_side_pools_and_hit_policies(tmp_path):
    """A side pool (here a second KV pool standing in for a draft / SWA pool) gets its own shard; v2 calls
    move its pages and batch_exists_v2 folds SGLang's hit policies into the usable prefix."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    kv, side = mha_host_pool("page_first"), mha_host_pool("page_first", layers=1)
    fill_random(kv, seed=11)
    fill_random(side, seed=12)
    backend = make_backend(tmp_path, kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(side, PoolName.DRAFT)
    backend.on_host_pools_registered()
    assert backend.shards["draft"].namespace.layout.startswith("draft/")
    keys = chain_keys(6)
    assert backend.batch_set_v1(keys, slots([0, 1, 2, 3, 4, 5])) == [True] * 6
    # The side pool holds pages 0-2 and 5 (say, a trailing window), not 3-4.
    written = backend.batch_set_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=slots([0, 1, 2, 5]),
                                                 keys=keys[:3] + keys[5:])])
    assert written == {"draft": [True] * 4}

    every = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.DRAFT, keys=keys,
                                                        hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert every.kv_hit_pages == 3 and every.extra_pool_hit_pages["draft"] == 3
    trailing = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.DRAFT, keys=keys[:1],
                                                           hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert trailing.kv_hit_pages == 6  # only the last page of a prefix must be there: 6 is restorable
    assert trailing.restorable_prefix_pages == [1, 2, 3, 6]

    expected = [page_bytes(side, p * PS) for p in (0, 1, 2)]
    zero(side)
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=slots([9, 10, 11, 12]),
                                             keys=keys[:4])])
    assert got == {"draft": [True, True, True, False]}
    assert [page_bytes(side, p * PS) for p in (9, 10, 11)] == expected
    bad = backend.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=slots([9]), keys=keys[:2])])
    assert bad == {"draft": [False, False]}  # indices for one page, two keys: refused, not truncated
    backend.close()



def test_v2_retry_sees_what_another_writer_committed_to_every_pool_since_its_miss(tmp_path):
    """Two backends on one directory: two writers of each pool. The consumer's v2 query misses; the producer
    commits KV pages, then the side pool's: each retry of the query sees what was committed before it, in the
    KV pool and in the side pool alike (a side pool short of the KV prefix re-reads its writers as the KV pool
    does). ``follow_interval_s`` = 600: nothing is re-read but by that rule."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    def backend(seed: int):
        kv, side = mha_host_pool("page_first"), mha_host_pool("page_first", layers=1)
        fill_random(kv, seed=seed)
        fill_random(side, seed=seed + 1)
        made = make_backend(tmp_path, kv, follow_interval_s=600.0, readahead_bytes=0)
        made.register_mem_host_pool_v2(kv, PoolName.KV)
        made.register_mem_host_pool_v2(side, PoolName.DRAFT)
        made.on_host_pools_registered()
        return made, side

    consumer, _ = backend(20)
    producer, side = backend(30)
    assert consumer.kv is not None and producer.kv is not None
    assert consumer.kv.store.wid != producer.kv.store.wid
    keys = chain_keys(6)

    def query():
        return consumer.batch_exists_v2(keys, [PoolTransfer(name=PoolName.DRAFT, keys=keys,
                                                            hit_policy=PoolHitPolicy.ALL_PAGES)])

    assert query().kv_hit_pages == 0  # the miss
    assert producer.batch_set_v1(keys, slots([0, 1, 2, 3, 4, 5])) == [True] * 6
    assert consumer.batch_exists(keys) == 6  # v1: the retry sees the KV pages
    retried = query()
    assert retried.kv_hit_pages == 0 and retried.restorable_prefix_pages == []  # no side pages yet
    assert producer.batch_set_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=slots([0, 1, 2, 3, 4, 5]),
                                               keys=keys)]) == {"draft": [True] * 6}
    again = query()
    assert again.kv_hit_pages == 6 and again.extra_pool_hit_pages["draft"] == 6
    got = consumer.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=slots([10, 11, 12, 13, 14, 15]),
                                              keys=keys)])
    assert got == {"draft": [True] * 6}
    consumer_side = consumer.shards["draft"].pages.pool
    assert [page_bytes(consumer_side, p * PS) for p in range(10, 16)] == [page_bytes(side, p * PS) for p in range(6)]
    assert consumer.boundary.counts().expected + consumer.boundary.counts().unexpected == 0
    producer.close()
    consumer.close()
