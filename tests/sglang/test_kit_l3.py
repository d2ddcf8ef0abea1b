"""KVTierStorage under SGLang's real UnifiedRadixCache, driven by SGLang's own shipped test kits (``kit_l3``).

Each scenario runs for every kit cache config the CPU can build (``kit_l3.RUNNABLE``: the 5 FULL and the
8 FULL+SWA configs of ``sglang.test.kits.unified_radix_cache.config.CONFIGS``; the 4 FULL+Mamba and 2
FULL+SWA+Mamba ones cannot run here, ``kit_l3.cannot_run`` says why), through the kits' own helpers:

* L3 produce / consume: a prefix one cache wrote is served from L3 to a fresh cache (device and host
  copies gone), byte-exact, with host memory as a cache tier and as staging only (``buffer_only``), and every pool SGLang registered (KV, and SWA where the model has it) is
  served by a tier of its own, the tiers' capacities adding up to at most the backend's one limit;
* prefetch corruption: a page damaged on flash is a miss (the prefix stops before it, what loads is
  exact, the store counts it), and a host chain committed under corrupt hashes never reaches L3;
* runtime attach / detach: storage attached to a live tree backfills its hash chains exactly as a
  tree built with storage on; detach releases everything; a re-attach serves the pages stored before;
* retry after a miss: SGLang's retry machinery re-issues a missed L3 query and, the prefix stored and
  its L1/L2 copies evicted meanwhile, the retry is served from L3; and with host memory as staging only
  (``buffer_only``: the side-pool calls, ``batch_exists_v2``), a consumer's query misses, a producer cache
  running beside it (another writer of the same pool) commits the span, and the consumer's paced retry
  hits and stages it, byte-exact.
"""

from __future__ import annotations

import random
import unittest
from array import array
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

if torch.cuda.is_available():  # pragma: no cover - the CPU pools and shims of kit_l3 are CPU-only
    pytest.skip("CPU harness: CPU KV pools and the CPU shims", allow_module_level=True)

from kit_l3 import LIMIT, RUNNABLE, KVTierKit, config_classes  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, EvictParams  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.test.kits.unified_radix_cache import fixtures as kit  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import requires  # noqa: E402
from support import lock_free_elsewhere, open_fds_under  # noqa: E402

from sgl_kvtier.errors import StoreLockedError  # noqa: E402
from sgl_kvtier.sglang.capacity import slot_bytes  # noqa: E402

pytestmark = pytest.mark.timeout(300)

full_only = requires(lambda cfg: not cfg.has_swa, "the kit's device-only insert allocates FULL-only")
plain_alloc = requires(lambda cfg: not (cfg.has_swa and cfg.page_size > 1),
                       "the kit's two-level tree allocates with alloc(), which paged SWA refuses")


class L3Scenarios(KVTierKit):
    def _hashes(self, seq: list[int]) -> list[str]:
        return get_storage_hash_str(seq, None, page_size=self.cfg.page_size)

    def _loads_back(self, cache, allocator, seq: list[int], expected) -> None:
        """``seq`` is host-resident only; loading it to the device gives exactly ``expected`` (K, V)."""
        match = kit.match_prefix(cache, seq)
        self.assertEqual((match.device_prefix_len, match.host_hit_length), (0, len(seq)))
        self._load_back_node(cache, match.last_host_node)
        match = kit.match_prefix(cache, seq)
        self.assertEqual(match.device_prefix_len, len(seq))
        k, v = self._snapshot_full_kv(allocator, cache.path_device_indices(match.last_device_node))
        self.assertTrue(torch.equal(k, expected[0]) and torch.equal(v, expected[1]), "KV loaded from L3 differs")

    def _consume(self, cache, seq: list[int], rid: str) -> int:
        handle = CacheRequestHandle(rid, 0)
        self._consume_prefetch(cache, seq, handle)
        return cache.pop_prefetch_loaded_tokens(handle)

    # ------------------------------------------------------------------ L3 produce / consume
    def test_a_prefix_produced_by_one_cache_is_served_from_l3_to_the_next(self):
        storage_dir = self._make_storage_dir()
        seq = self._buffer_swa_seq(min_pages=4)
        expected = self._l3_produce(storage_dir, seq, marker=7)
        cons, allocator, _ = self._l3_consumer(storage_dir)  # the producer let go of the shards first
        self.assertEqual(kit.match_prefix(cons, seq).full_kv_hit_length, 0)
        hashes = self._hashes(seq)
        self.assertEqual(self._storage_exists_count(cons, hashes), len(hashes))
        self.assertEqual(self._consume(cons, seq, "consume"), len(seq))
        self._loads_back(cons, allocator, seq, expected)

    def test_buffer_only_host_memory_produces_and_consumes_through_l3(self):
        """``--hicache-host-memory-mode buffer_only``: host memory is staging only, so L3 is the cache tier."""
        storage_dir = self._make_storage_dir()
        seq = self._buffer_swa_seq(min_pages=4)
        _, expected = self._produce_buffer_l3(storage_dir, seq, marker=4)
        cons, allocator, _ = self._build_buffer_hicache_fixture(storage_dir)
        self.assertEqual(kit.match_prefix(cons, seq).full_kv_hit_length, 0)
        handle = CacheRequestHandle("buffered", 0)
        cons.prefetch_from_storage(handle, cons.root_node_handle(), array("q", seq), None, None)
        self._run_prefetch_to_completion(cons, handle)  # staged, then consumed as admission would
        match = kit.match_prefix(cons, seq)
        self.assertEqual(match.device_prefix_len, len(seq))
        k, v = self._snapshot_full_kv(allocator, cons.path_device_indices(match.last_device_node))
        self.assertTrue(torch.equal(k, expected[0]) and torch.equal(v, expected[1]), "KV loaded from L3 differs")

    def test_every_registered_pool_is_served_within_one_capacity(self):
        storage_dir = self._make_storage_dir()
        self._l3_produce(storage_dir, self._buffer_swa_seq(min_pages=4))
        cons, _, _ = self._l3_consumer(storage_dir)
        backend = self.backend(cons)
        registered = {str(e.name.value) for e in cons.cache_controller.mem_pool_host.entries}
        self.assertEqual(set(backend.shards), registered)
        self.assertEqual(registered, {"kv", "swa"} if self.cfg.has_swa else {"kv"})
        capacity = {name: t.store.stats().capacity_bytes for name, t in backend.shards.items()}
        self.assertLessEqual(sum(capacity.values()), LIMIT)
        slots = {name: slot_bytes(t.namespace) for name, t in backend.shards.items()}
        pages = LIMIT // sum(slots.values())  # the split: room for as many pages in every pool, one device
        self.assertEqual(capacity, {name: pages * slot for name, slot in slots.items()})
        self.assertTrue(all(len(t.store) > 0 for t in backend.shards.values()), "a pool's pages never reached L3")

    # ------------------------------------------------------------------ prefetch corruption
    def test_a_page_damaged_on_flash_is_a_miss_never_garbage(self):
        storage_dir = self._make_storage_dir()
        seq = self._buffer_swa_seq(min_pages=4)
        n_pages = len(seq) // self.cfg.page_size
        expected = self._l3_produce(storage_dir, seq, marker=9)
        victim = n_pages // 2
        store = self.backend(self._holders[storage_dir]).kv.store
        slot = store.slot_of(bytes.fromhex(self._hashes(seq)[victim]))
        arena = store.layout.arenas[0]
        segment = arena.dir / f"seg-{slot // arena.slots_per_segment:05d}.dat"
        offset = slot % arena.slots_per_segment * store.slot_bytes + random.Random(victim).randrange(store.page_bytes)
        self._hand_over(storage_dir)  # the producer exits
        with open(segment, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x10]))
        cons, allocator, _ = self._l3_consumer(storage_dir)
        loaded = self._consume(cons, seq, "corrupt")
        # The KV prefix stops before the damaged page. With SWA, the window SGLang fetched alongside is the one
        # ending where the hit query said (the undamaged index holds every page): it does not fit the shorter
        # KV run, so nothing is usable and the whole prefix is recomputed. Never the damaged bytes.
        self.assertEqual(loaded, 0 if self.cfg.has_swa else victim * self.cfg.page_size)
        if loaded:
            self._loads_back(cons, allocator, seq[:loaded], (expected[0][:loaded], expected[1][:loaded]))
        counters = self.backend(cons).kv.store.stats().counters
        self.assertEqual(counters["corrupt_pages"], 1)

    @full_only
    def test_a_host_chain_committed_under_corrupt_hashes_never_reaches_l3(self):
        storage_dir = self._make_storage_dir()
        cache, allocator, _ = kit.build_fixture(self.cfg)
        self._init_hicache(cache, storage_backend="file", storage_dir=storage_dir, prefetch_threshold=1)
        parent_tokens = list(range(1000, 1000 + 2 * self.ps))
        parent = self._insert_device(cache, allocator, parent_tokens)
        self._backup_node(cache, parent)
        self._write_path_to_l3(cache, parent)
        self._flush_l3_backups(cache)
        child = self._attach_host_child(cache, parent, start_token=5000)  # the kit's corrupt commit: "h0", "h1"
        bogus = cache.tree_core.get_hash_values(child)
        cache.write_backup_storage(child)
        self._flush_l3_backups(cache)
        backend = self.backend(cache)
        self.assertEqual(self._storage_exists_count(cache, bogus), 0)
        self.assertEqual(self._storage_exists_count(cache, self._hashes(parent_tokens) + bogus), 2)
        self.assertEqual(len(backend.kv.store), 2)  # the parent's pages only
        self.assertEqual(backend.boundary.counts().expected + backend.boundary.counts().unexpected, 0)

    # ------------------------------------------------------------------ runtime attach / detach
    @plain_alloc
    def test_attach_at_runtime_backfills_then_detach_releases_and_reattach_serves(self):
        ps = self.cfg.page_size
        self.prefix_tokens = array("q", range(100, 100 + 2 * ps))
        self.suffix_tokens = array("q", range(500, 500 + 2 * ps))
        reference = self._hashes_by_token_ids(self._build_two_level_tree(storage_on_from_the_start=True))
        cache, allocator, rtp = kit.build_fixture(self.cfg)
        self._init_hicache(cache)  # HiCache without L3, as a server started without a storage backend
        full = list(self.prefix_tokens + self.suffix_tokens)
        self._insert(cache, allocator, rtp, list(self.prefix_tokens))
        self._insert(cache, allocator, rtp, full)
        self.assertTrue(all(h is None for h in self._hashes_by_token_ids(cache).values()))

        storage_dir = self._make_storage_dir()
        first = self._attach(cache, storage_dir)
        self.assertEqual(self._hashes_by_token_ids(cache), reference)  # backfilled, chained from the root
        leaf = kit.match_prefix(cache, full).last_device_node
        self._fill_full_kv(allocator, cache.path_device_indices(leaf), marker=3)
        expected = self._snapshot_full_kv(allocator, cache.path_device_indices(leaf))
        self._backup_node(cache, leaf)
        self._write_path_to_l3(cache, leaf)
        self._flush_l3_backups(cache)
        hashes = self._all_page_hashes(cache, leaf)
        self.assertEqual(hashes, self._hashes(full))
        self.assertEqual(self._storage_exists_count(cache, hashes), len(hashes))
        metas = [t.store.layout.meta for t in first.shards.values()]

        self._hand_over(storage_dir)  # DELETE /hicache/storage-backend
        self.assertEqual((first.shards, first.kv), ({}, None))
        self.assertEqual(open_fds_under(storage_dir), {})
        self.assertTrue(all(lock_free_elsewhere(meta) for meta in metas), "a writer lock outlived the detach")
        cache.reset()  # /flush_cache: L1 and L2 dropped, L3 kept
        allocator.clear()

        second = self._attach(cache, storage_dir)  # PUT /hicache/storage-backend: a new backend, same devices
        self.assertIsNot(second, first)
        self.assertEqual(self._storage_exists_count(cache, hashes), len(hashes))
        self.assertEqual(self._consume(cache, full, "reattached"), len(full))
        self._loads_back(cache, allocator, full, expected)

    # ------------------------------------------------------------------ retry after a miss
    def test_a_missed_l3_query_is_retried_and_served_once_the_prefix_is_stored(self):
        storage_dir = self._make_storage_dir()
        cache, allocator, rtp = self._l3_consumer(storage_dir)
        seq = self._buffer_swa_seq(min_pages=4)
        head, req = self._make_req(rtp), self._make_req(rtp)  # a miss at the queue head is not retried
        waiting = [head, req]
        first = CacheRequestHandle(req.rid, 0)
        self._consume_prefetch(cache, seq, first)  # nothing in L3 yet: a miss
        self.assertEqual(cache.pop_prefetch_loaded_tokens(first), 0)
        retries = cache.storage_prefetch_retries
        self.assertEqual(retries.pop_ready(waiting, 1, 8), [])  # armed, due one scheduling pass later

        # Meanwhile another request computes the prefix: it reaches L2 and L3, then L1 and L2 evict it.
        self._insert(cache, allocator, rtp, seq)
        leaf = kit.match_prefix(cache, seq).last_device_node
        self._fill_full_kv(allocator, cache.path_device_indices(leaf), marker=5)
        expected = self._snapshot_full_kv(allocator, cache.path_device_indices(leaf))
        self._backup_node(cache, leaf)
        self._write_path_to_l3(cache, leaf)
        self._flush_l3_backups(cache)
        cache.evict(EvictParams(num_tokens=len(seq), swa_num_tokens=len(seq)))
        cache.evict_host(len(seq))
        self.assertEqual(kit.match_prefix(cache, seq).full_kv_hit_length, 0)

        ready = retries.pop_ready(waiting, 1, 8)
        self.assertEqual([r for r, _ in ready], [req])
        req.storage_prefetch_retry_attempts += 1  # as the scheduler's _retry_storage_prefetch does
        retry = CacheRequestHandle(req.rid, 1)
        self._consume_prefetch(cache, seq, retry)
        self.assertEqual(cache.pop_prefetch_loaded_tokens(retry), len(seq))
        self._loads_back(cache, allocator, seq, expected)

    def test_a_retry_after_a_miss_stages_what_another_writer_committed_since(self):
        """SGLang's buffer_only miss-marker-and-retry flow with the producer a second writer of the pool: the
        consumer's query comes before any page is there (a full miss, its retry armed once); the producer,
        running beside it, commits the span; the consumer's paced retry must see that commit and stage it."""
        storage_dir = self._make_storage_dir()
        self._pooled.add(storage_dir)  # the producer joins the consumer's pool: both stay attached
        seq = self._buffer_swa_seq()
        cons, allocator, _ = self._build_buffer_hicache_fixture(storage_dir)
        handle = CacheRequestHandle("early-miss", 0)
        cons.prefetch_from_storage(handle, cons.root_node_handle(), array("q", seq), None, None)
        self._pump_hicache_until(cons, lambda: cons.check_prefetch_progress(handle), "the miss did not resolve")
        self.assertFalse(cons.buffer_pipeline.has_staged(handle))
        self.assertEqual(cons._prefetch_outcome_stats["revoked_full_miss"], 1)
        waiting = [SimpleNamespace(rid="head", storage_prefetch_retry_attempts=0),
                   SimpleNamespace(rid=handle.rid, storage_prefetch_retry_attempts=0)]
        retries = cons.storage_prefetch_retries
        self.assertEqual(retries.pop_ready(waiting, 1, 8), [])  # armed, due one scheduling pass later
        self.assertEqual(retries.pop_ready(waiting, 1, 8), [(waiting[1], None)])

        _, expected = self._produce_buffer_l3(storage_dir, seq, marker=6)  # another writer of the pool commits
        producer, consumer = self.backend(self._holders[storage_dir]), self.backend(cons)
        self.assertIsNot(producer, consumer)
        assert producer.kv is not None and consumer.kv is not None
        self.assertNotEqual(producer.kv.store.wid, consumer.kv.store.wid)

        cons.prefetch_from_storage(handle, cons.root_node_handle(), array("q", seq), None, None)  # the retry
        self._pump_hicache_until(
            cons, lambda: cons.check_prefetch_progress(handle) and cons.buffer_pipeline.has_staged(handle),
            "retried prefetch did not stage")
        self.assertNotIn(handle.rid, retries._pending)
        self.assertEqual(cons.pop_prefetch_loaded_tokens(handle), len(seq))
        spliced = self._consume_staged_prefetch(cons, handle)
        self.assertEqual(int(spliced.numel()), len(seq))
        k, v = self._snapshot_full_kv(allocator, spliced)
        self.assertTrue(torch.equal(k, expected[0]) and torch.equal(v, expected[1]), "KV staged from L3 differs")


config_classes(L3Scenarios, globals())


class TestOneWriterPerShard(KVTierKit, unittest.TestCase):
    """One L3 cache per directory with ``sharing = "off"``: a second one is refused (the kit's hand-over)."""

    cfg = RUNNABLE[1]

    def test_a_second_cache_on_a_held_directory_is_refused_at_attach(self):
        """With ``sharing = "off"``; by default (``"host"``) the second one would share the pool, each in its
        own writer directory (tests/sharing/test_sharing.py)."""
        storage_dir = self._make_storage_dir()
        self._l3_consumer(storage_dir)
        holder = self._holders.pop(storage_dir)  # keep the first cache attached
        cache, _, _ = kit.build_fixture(self.cfg)
        with self.assertRaises(StoreLockedError):
            self._init_hicache(cache, storage_backend="file", storage_dir=storage_dir, prefetch_threshold=1,
                               storage_extra={"sharing": "off"})
        self.assertTrue(holder.cache_controller.enable_storage)  # the holder keeps serving
