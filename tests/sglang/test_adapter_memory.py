"""Nothing is retained after close: a closed KVTierStorage, and everything it held, goes by reference counting
alone, at once, with the cyclic garbage collector off.

With the collector off, anything kept alive only by a reference cycle stays for the rest of the test, so
each check here fails on a cycle through the backend (its parts calling back into it strongly), not only on
a leak for good. Over real SGLang host pools on the CPU (``pools.mha_host_pool``; in the rounds 64 MiB
each, touched whole so that they are resident):

* a backend opened, written, read back and closed, and its host pool dropped, leaves no backend and no
  host pool alive (weak references dead without ``gc.collect``), round after round, with read-ahead off
  and on; the process's RSS (``rss``: the C allocator's free memory handed back first) after the last of
  20 rounds is within a quarter of one pool of the RSS after the first (with the cycles it grew by ~97 MiB
  a round, the pool and the device pool it was made from: 1.8 GiB over the 20);
* a closed backend that someone still holds keeps no host pool alive (SGLang's admin detach, or a test,
  may keep it); one whose close failed (a real failed checkpoint write) is gone at once all the same: no
  frame of the error's traceback keeps it;
* through SGLang's own UnifiedRadixCache (``kit_l3.KVTierKit``, a FULL+SWA model: ``kv`` and ``swa`` tiers,
  read-ahead on): a backend SGLang detaches (``detach_storage_backend``, the admin ``DELETE`` path), opened
  at the cache's HiCache init (the next one on the same devices serving what the first stored) or
  attached at run time (the admin ``PUT`` path), is gone the moment the detach returns.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import unittest
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import psutil  # noqa: E402
import torch  # noqa: E402

if torch.cuda.is_available():  # pragma: no cover - the CPU pools and shims of kit_l3 are CPU-only
    pytest.skip("CPU harness: CPU KV pools and the CPU shims", allow_module_level=True)

from kit_l3 import RUNNABLE, KVTierKit  # noqa: E402
from pools import mha_host_pool, page_bytes  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.test.kits.unified_radix_cache import fixtures as kit  # noqa: E402
from support import OSFaults  # noqa: E402
from test_storage_adapter import PS, chain_keys, make_backend, slots  # noqa: E402

from sgl_kvtier.store import devices  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ROUNDS = 20
POOL_TOKENS = 32768  # the host pool: 2 x this many tokens of 1 KiB (2 layers, 2 heads, dim 64, bf16): 64 MiB
PAGES = 8  # written and read back per round
LIBC = ctypes.CDLL(None)


@contextmanager
def cyclic_gc_off() -> Iterator[None]:
    """The cyclic collector off for the block (what is garbage before it is collected first)."""
    was_on = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def rss() -> int:
    """This process's RSS once the C allocator has handed its free memory back (glibc's ``malloc_trim``): the
    freed blocks it keeps for reuse (16-80 MiB here, up and down) are not what this file looks for."""
    trim = getattr(LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
    return int(psutil.Process().memory_info().rss)


def one_round(path: Path, i: int, readahead: int) -> tuple[weakref.ref[Any], weakref.ref[Any], int]:
    """Open a backend over a fresh, resident host pool; write ``PAGES`` pages, read them (and the last round's)
    back byte-exact; close. Returns weak references to the backend and the pool, and the pool's bytes."""
    pool = mha_host_pool("layer_first", tokens=POOL_TOKENS)
    pool.kv_buffer.view(torch.uint8).fill_(i % 251 + 1)  # every page resident
    for p in range(PAGES):
        pool.kv_buffer[:, :, p * PS] = float(p)  # pages differ
    backend = make_backend(path, pool, readahead_bytes=readahead)
    keys = chain_keys(PAGES, seed=f"round {i}")
    assert backend.batch_set_v1(keys, slots(list(range(PAGES)))) == [True] * PAGES
    assert backend.batch_exists(keys) == PAGES  # with read-ahead on: the reads start here
    dst = list(range(PAGES, 2 * PAGES))
    assert backend.batch_get_v1(keys, slots(dst)) == [True] * PAGES
    assert [page_bytes(pool, d * PS) for d in dst] == [page_bytes(pool, p * PS) for p in range(PAGES)]
    if i:  # the previous backend's pages, through this one: the devices were handed over whole
        assert backend.batch_exists(chain_keys(PAGES, seed=f"round {i - 1}")) == PAGES
    backend.close()
    size = pool.kv_buffer.nbytes
    return weakref.ref(backend), weakref.ref(pool), size


@pytest.mark.parametrize("readahead", [0, 16 << 20], ids=["readahead-off", "readahead-on"])
def test_closed_backends_free_their_host_pools_at_once_and_rss_stays_flat(tmp_path: Path, readahead: int) -> None:
    with cyclic_gc_off():
        first = 0
        for i in range(ROUNDS):
            backend, pool, size = one_round(tmp_path, i, readahead)
            assert backend() is None, f"round {i}: the closed backend outlived its last reference"
            assert pool() is None, f"round {i}: the host pool outlived the closed backend"
            first = first or rss()
        grown = rss() - first
        assert grown < size // 4, f"RSS grew by {grown >> 20} MiB over {ROUNDS - 1} rounds of {size >> 20} MiB pools"


def test_a_closed_backend_still_held_keeps_no_host_pool(tmp_path: Path) -> None:
    with cyclic_gc_off():
        pool = mha_host_pool("layer_first")
        backend = make_backend(tmp_path, pool)
        backend.register_mem_host_pool_v2(pool, "kv")  # SGLang's HostPoolGroup registration, the KV pool again
        backend.close()
        held = weakref.ref(pool)
        del pool
        assert held() is None, "the closed backend kept its host pool"
        backend.close()  # idempotent, holding nothing
        assert backend.kv is None and backend.shards == {}


def test_a_backend_whose_close_fails_is_gone_at_once_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The KV store's checkpoint cannot be written (ENOSPC, a real failed write): the error is counted and
    logged, everything released, and no frame of its traceback keeps the backend or the pool."""
    with cyclic_gc_off():
        pool = mha_host_pool("layer_first")
        backend = make_backend(tmp_path, pool)
        assert backend.batch_set_v1(chain_keys(2), slots([1, 2])) == [True, True]
        faults = OSFaults(errno.ENOSPC, {"write"}, f"{backend.shards['kv'].store.layout.meta}/checkpoint")
        monkeypatch.setattr(devices, "os", faults)
        backend.close()
        monkeypatch.undo()
        assert faults.failed and backend.boundary.counts().expected == 1
        gone, held = weakref.ref(backend), weakref.ref(pool)
        del backend, pool
        assert gone() is None, "a backend whose close failed outlived its last reference"
        assert held() is None


class TestDetachedBackendsGoAtOnce(KVTierKit, unittest.TestCase):
    """SGLang's own detach (the admin ``DELETE /hicache/storage-backend`` path) lets our backend go at once."""

    cfg = next(c for c in RUNNABLE if c.label == "FULL_SWA_ps4_sw4")
    store_extra = {"readahead_bytes": 16 << 20}

    def _consume(self, cache: Any, seq: list[int], rid: str) -> int:
        handle = CacheRequestHandle(rid, 0)
        self._consume_prefetch(cache, seq, handle)
        return int(cache.pop_prefetch_loaded_tokens(handle))

    def _detach_is_final(self, storage_dir: str) -> None:
        backend = self.backend(self._holders[storage_dir])
        self.assertEqual(set(backend.shards), {"kv", "swa"})
        gone = weakref.ref(backend)
        del backend
        self._hand_over(storage_dir)  # SGLang's detach_storage_backend: it stops its threads, closes ours
        self.assertIsNone(gone(), "a detached backend outlived SGLang's detach")

    def test_each_backend_sglang_detaches_is_gone_when_the_detach_returns(self) -> None:
        storage_dir = self._make_storage_dir()
        seq = self._buffer_swa_seq(min_pages=4)
        with cyclic_gc_off():
            self._l3_produce(storage_dir, seq, marker=5)  # opened at the cache's HiCache init
            self._detach_is_final(storage_dir)
            for i in range(2):  # a fresh backend on the same devices serves what the first stored
                cache, _, _ = self._l3_consumer(storage_dir)
                self.assertEqual(self._consume(cache, seq, f"round {i}"), len(seq))
                self._detach_is_final(storage_dir)
            cache, _, _ = kit.build_fixture(self.cfg)
            self._init_hicache(cache)  # L2 only, as a server started without storage
            for _ in range(2):
                self._attach(cache, storage_dir)  # PUT /hicache/storage-backend, at run time
                self._detach_is_final(storage_dir)
