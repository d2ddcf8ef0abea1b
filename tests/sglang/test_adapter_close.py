"""Detach releases everything on every path, and a re-attach serves what was stored: one test per failure point.

A real UnifiedRadixCache (SGLang's kit, a FULL+SWA model: two pool tiers, ``kv`` and ``swa``) writes a
prefix to L3 through KVTierStorage; then SGLang's own runtime detach (``detach_storage_backend``, the admin
``DELETE /hicache/storage-backend`` path) closes the backend while one release step fails: a tier's store
close raising ``StoreCloseError`` (a real failed checkpoint: ENOSPC) or ``OSError``, or a tier's
read-ahead close raising. After each: SGLang's detach succeeded and logged no failure of its own (close
never raises into it); our boundary counted and logged the first failure once; no descriptor under the
store, no ``kvtier-*`` thread, no writer lock is left (another process takes every lock); and a new
KVTierStorage on the same directory in this process (``_l3_consumer``: a fresh cache attaching it)
serves the prefix stored before, byte-exact, from both tiers.
"""

from __future__ import annotations

import errno
import logging
import unittest
from collections.abc import Callable
from unittest import mock

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

if torch.cuda.is_available():  # pragma: no cover - the CPU pools and shims of kit_l3 are CPU-only
    pytest.skip("CPU harness: CPU KV pools and the CPU shims", allow_module_level=True)

from kit_l3 import RUNNABLE, KVTierKit  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.test.kits.unified_radix_cache import fixtures as kit  # noqa: E402
from support import OSFaults, kvtier_threads, lock_free_elsewhere, open_fds_under  # noqa: E402

from sgl_kvtier.store import devices  # noqa: E402
from sgl_kvtier.telemetry.counters import BoundaryCounts  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def then_raise(release: Callable[[], None], exc: BaseException) -> Callable[[], None]:
    """``release`` as it is (it still releases), then ``exc``: a release that reports an error."""
    def call() -> None:
        release()
        raise exc
    return call


class TestDetachReleasesEverything(KVTierKit, unittest.TestCase):
    cfg = next(c for c in RUNNABLE if c.label == "FULL_SWA_ps4_sw4")
    store_extra = {"readahead_bytes": 16 << 20}  # read-ahead on (off by default): its close is a failure point

    def setUp(self) -> None:
        super().setUp()
        self.threads_before = kvtier_threads()
        self.storage_dir = self._make_storage_dir()
        self.seq = self._buffer_swa_seq(min_pages=4)
        self.expected = self._l3_produce(self.storage_dir, self.seq, marker=11)
        self.first = self.backend(self._holders[self.storage_dir])
        self.assertEqual(set(self.first.shards), {"kv", "swa"})
        self.metas = [t.store.layout.meta for t in self.first.shards.values()]
        self.stored = {name: len(t.store) for name, t in self.first.shards.items()}
        self.faults_off: list[Callable[[], None]] = []

    def detach_failing(self, first: str, *also: str) -> list[logging.LogRecord]:
        """Detach through SGLang; ``first`` is the failing step our boundary must report, ``also`` the later
        ones (notes on it, and warnings). Checks everything was released; returns the records."""
        with self.assertLogs(level=logging.INFO) as logs:
            self._hand_over(self.storage_dir)  # asserts SGLang's detach answered success
        for stop in self.faults_off:
            stop()
        records = logs.records
        self.assertEqual([r for r in records if r.name.startswith("sglang") and r.levelno >= logging.ERROR], [])
        self.assertEqual(self.first.boundary.counts(), BoundaryCounts(expected=1, unexpected=0))
        [reported] = [r for r in records if r.getMessage().startswith("kvtier close (")]
        self.assertTrue(reported.getMessage().startswith(f"kvtier close ({first}) failed"), reported.getMessage())
        warned = [r.getMessage() for r in records if "also failed" in r.getMessage()]
        self.assertEqual([w.split(" also failed")[0] for w in warned], [f"kvtier close: {s}" for s in also])
        self.assertEqual((self.first.shards, self.first.kv), ({}, None))
        self.assertEqual(open_fds_under(self.storage_dir), {}, "descriptors of the store left open")
        self.assertEqual(kvtier_threads() - self.threads_before, set(), "kvtier threads left running")
        self.assertTrue(all(lock_free_elsewhere(meta) for meta in self.metas), "a writer lock is still held")
        self.first.close()  # idempotent: nothing more to release, nothing more reported
        self.assertEqual(self.first.boundary.counts(), BoundaryCounts(expected=1, unexpected=0))
        return records

    def reattach_serves_what_was_stored(self) -> None:
        cons, allocator, _ = self._l3_consumer(self.storage_dir)  # a new KVTierStorage, same directory
        again = self.backend(cons)
        self.assertIsNot(again, self.first)
        self.assertEqual({name: len(t.store) for name, t in again.shards.items()}, self.stored)
        hashes = get_storage_hash_str(self.seq, None, page_size=self.cfg.page_size)
        self.assertEqual(self._storage_exists_count(cons, hashes), len(hashes))
        handle = CacheRequestHandle("reattached", 0)
        self._consume_prefetch(cons, self.seq, handle)
        self.assertEqual(cons.pop_prefetch_loaded_tokens(handle), len(self.seq))
        match = kit.match_prefix(cons, self.seq)
        self._load_back_node(cons, match.last_host_node)
        match = kit.match_prefix(cons, self.seq)
        k, v = self._snapshot_full_kv(allocator, cons.path_device_indices(match.last_device_node))
        self.assertTrue(torch.equal(k, self.expected[0]) and torch.equal(v, self.expected[1]))

    def failing_checkpoint(self, pool: str) -> OSFaults:
        """The pool's next checkpoint cannot be written (ENOSPC): its store close raises StoreCloseError."""
        meta = self.first.shards[pool].store.layout.meta
        faults = OSFaults(errno.ENOSPC, {"write"}, f"{meta}/checkpoint")
        patcher = mock.patch.object(devices, "os", faults)
        patcher.start()
        self.faults_off.append(patcher.stop)  # the device recovers once the detach is over
        return faults

    # ------------------------------------------------------------------ one test per failure point
    def _store_close_error(self, pool: str) -> None:
        faults = self.failing_checkpoint(pool)
        records = self.detach_failing(f"pool {pool}")
        self.assertTrue(faults.failed)
        [reported] = [r for r in records if r.getMessage().startswith("kvtier close (")]
        self.assertIn("StoreCloseError", reported.getMessage())
        self.assertIn("checkpoint failed", reported.getMessage())
        self.reattach_serves_what_was_stored()  # from the journal: the checkpoint never landed

    def test_the_kv_store_close_raises_store_close_error(self):
        self._store_close_error("kv")

    def test_a_side_pool_store_close_raises_store_close_error(self):
        self._store_close_error("swa")

    def _store_close_os_error(self, pool: str) -> None:
        store = self.first.shards[pool].store
        store.close = then_raise(store.close, OSError(errno.EIO, "injected EIO closing the store"))
        records = self.detach_failing(f"pool {pool}")
        self.assertTrue(any("OSError" in r.getMessage() and "EIO" in r.getMessage() for r in records))
        self.reattach_serves_what_was_stored()

    def test_the_kv_store_close_raises_os_error(self):
        self._store_close_os_error("kv")

    def test_a_side_pool_store_close_raises_os_error(self):
        self._store_close_os_error("swa")

    def _read_ahead_close_raises(self, pool: str) -> None:
        stage = self.first.shards[pool].readahead
        self.assertIsNotNone(stage)
        stage.close = then_raise(stage.close, RuntimeError("injected read-ahead failure"))
        records = self.detach_failing(f"pool {pool}")
        self.assertTrue(any("injected read-ahead failure" in r.getMessage() for r in records))
        self.reattach_serves_what_was_stored()  # the store behind it was closed all the same

    def test_the_kv_read_ahead_close_raises(self):
        self._read_ahead_close_raises("kv")

    def test_a_side_pool_read_ahead_close_raises(self):
        self._read_ahead_close_raises("swa")

    def test_every_tier_fails_the_first_is_reported_the_other_noted(self):
        self.failing_checkpoint("kv")
        stage = self.first.shards["swa"].readahead
        stage.close = then_raise(stage.close, RuntimeError("injected read-ahead failure"))
        records = self.detach_failing("pool kv", "pool swa")
        [reported] = [r for r in records if r.getMessage().startswith("kvtier close (")]
        self.assertIn("StoreCloseError", reported.getMessage())
        self.reattach_serves_what_was_stored()

    def test_a_clean_detach_reports_nothing(self):
        self._hand_over(self.storage_dir)
        self.assertEqual(self.first.boundary.counts(), BoundaryCounts(expected=0, unexpected=0))
        self.assertEqual(open_fds_under(self.storage_dir), {})
        self.assertTrue(all(lock_free_elsewhere(meta) for meta in self.metas))
        self.reattach_serves_what_was_stored()

