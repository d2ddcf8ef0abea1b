"""SGLang's HiCache L3 backends as its controller drives them, for ``bench_backends``.

Both backends are made by SGLang's ``StorageBackendFactory`` ("file" with ``file_storage_path``; "dynamic" with
``interface_v1`` for ``KVTierStorage``), get SGLang's real ``MHATokenToKVPoolHost`` (CPU, pin_memory=False, 64-token
pages, 256 KiB per layer in every dtype: 8 KV heads of 128 in bf16, 4 in float32) through ``register_mem_pool_host``, and are driven by the controller's own page functions
(``HiCacheController._generic_page_set/_generic_page_get`` for ``file``, ``_page_set_zero_copy/_page_get_zero_copy``
for ours, chosen by the controller's rule).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from benchmarks.common import store_room
from sgl_kvtier.config import MiB

PAGE_TOKENS, HEAD_DIM = 64, 128
# One layer of one page (K+V), whatever the dtype: 64 tokens x 8 KV heads x 128 x 2 x 2 B in bf16 = 256 KiB; the
# KV heads follow the dtype (4 in float32), so --page-mib means the same pages and layer counts in every dtype.
LAYER_BYTES = 256 * 1024


class BenchOp:
    """What the controller's page functions read from ``self`` (a prefetch op that is never terminated)."""

    request_id = "bench"

    @staticmethod
    def is_terminated() -> bool:
        return False


class ControllerPath:
    """SGLang's own HiCacheController page get/set functions, bound to a stand-in carrying the attributes they use.

    The family is picked exactly as ``attach_storage_backend`` does: zero-copy v1 for ``dynamic`` with a truthy
    ``interface_v1``, else the legacy copy path (``get_data_page`` flat copies / dummy pages +
    ``set_from_flat_data_page``)."""

    def __init__(self, backend_type: str, backend, pool, extra: dict):
        self.storage_backend, self.storage_host_pool, self.mem_pool_host = backend, pool, pool
        self.page_size = pool.page_size
        c = HiCacheController
        self.zero_copy = backend_type == "dynamic" and bool(extra.get("interface_v1", 0))
        self.set = partial(c._page_set_zero_copy if self.zero_copy else c._generic_page_set, self)
        self.get = partial(c._page_get_zero_copy if self.zero_copy else c._generic_page_get, self, BenchOp())


def kv_heads(dtype: torch.dtype) -> int:
    """KV heads of head_dim 128 that make one layer of a 64-token page ``LAYER_BYTES`` in ``dtype``."""
    return LAYER_BYTES // (PAGE_TOKENS * 2 * HEAD_DIM * dtype.itemsize)


def host_pool(page_mib: float, layout: str, pages: int, dtype: torch.dtype = torch.bfloat16) -> MHATokenToKVPoolHost:
    """SGLang's real MHA host pool of ``pages`` pages (64 tokens, ``kv_heads(dtype)`` KV heads, head_dim 128, in
    ``dtype``), random bytes."""
    layers = int(page_mib * MiB) // LAYER_BYTES
    if layers * LAYER_BYTES != int(page_mib * MiB):
        raise SystemExit(f"--page-mib {page_mib}: must be a multiple of {LAYER_BYTES / MiB} MiB (one layer)")
    device = MHATokenToKVPool(2 * PAGE_TOKENS, PAGE_TOKENS, dtype, kv_heads(dtype), HEAD_DIM, layers, "cpu", False,
                              start_layer=0, end_layer=layers - 1)
    pool = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE_TOKENS, layout,
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                                end_layer=layers - 1, host_token_capacity=pages * PAGE_TOKENS)
    pool.bench_device_pool = device  # keep the device buffers the pool's buffer info points at alive
    words = pool.kv_buffer.view(torch.uint8).reshape(-1).numpy().view(np.uint64)
    rng = np.random.default_rng(1)
    for start in range(0, words.size, 8 * MiB):
        chunk = words[start:start + 8 * MiB]
        chunk[:] = rng.integers(0, 1 << 63, size=chunk.size, dtype=np.uint64)
    return pool


def slot_indices(pages) -> torch.Tensor:
    """Token-slot host_indices for the given page numbers (what the host allocator hands the controller)."""
    return torch.cat([torch.arange(int(p) * PAGE_TOKENS, (int(p) + 1) * PAGE_TOKENS, dtype=torch.int64) for p in pages])


def page_equal(pool, a: int, b: int) -> bool:
    """Bitwise page equality (int16 view: random bits contain NaNs in any float dtype)."""
    return torch.equal(pool.get_data_page(a * PAGE_TOKENS, flat=False).view(torch.int16),
                       pool.get_data_page(b * PAGE_TOKENS, flat=False).view(torch.int16))


def zero_pages(pool, pages) -> None:
    for p in pages:
        pool.get_data_page(int(p) * PAGE_TOKENS, flat=False).zero_()


def make_backend(kind: str, path: Path, pool, nbytes: int, io_depth: int, layout: str,
                 readahead_bytes: int | None = 0):
    """(backend, ControllerPath) made the way the controller's attach does: factory, then register the pool.

    ``readahead_bytes`` (kvtier only): 0 turns read-ahead off (the put/get rows measure the device path itself:
    read-ahead would move the reads into the timed-apart ``batch_exists``); None leaves the store's default."""
    if kind == "file":
        backend_type, extra = "file", {"file_storage_path": str(path)}
    else:
        backend_type, extra = "dynamic", {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang",
                                          "class_name": "KVTierStorage", "interface_v1": 1, "devices": [str(path)],
                                          "capacity_bytes": store_room(nbytes), "io_depth": io_depth}
        if readahead_bytes is not None:
            extra["readahead_bytes"] = readahead_bytes
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=layout != "layer_first", model_name="bench/model",
                               extra_config=extra)
    backend = StorageBackendFactory.create_backend(backend_type, cfg, pool)
    backend.register_mem_pool_host(pool)
    if kind == "file" and Path(backend.file_path) != path:
        raise RuntimeError(f"file backend writes to {backend.file_path}, not {path}")
    return backend, ControllerPath(backend_type, backend, pool, extra)


def close(backend) -> None:
    if hasattr(backend, "close"):  # the controller's detach does the same
        backend.close()


def readahead_counters(backend) -> dict[str, int]:
    """kvtier's read-ahead counters (staged, served, joined, ...); empty when off or not kvtier."""
    stage = getattr(getattr(backend, "kv", None), "readahead", None)
    return stage.counters.snapshot() if stage is not None else {}
