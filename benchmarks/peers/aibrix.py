"""AIBrix KV cache as SGLang's L3 (``--hicache-storage-backend aibrix``): its own L1 in DRAM and RocksDB as L2 on the
flash. It uses SGLang's older copy-based get/set, not the zero-copy v1 interface.

Package: ``aibrix-kvcache`` with ``--no-deps`` plus the pure-Python modules it imports that the project's venv lacks.
On CPU it allocates pinned memory whenever its device is ``cpu`` (``aibrix_kvcache/cache_manager.py``), which
fails without an NVIDIA driver; its module constant ``TESTING_DISABLE_PIN_MEMORY`` turns that off, set here by a
small import hook that the overlay venv loads (``aibrix_cpu.pth``) only in processes with ``KVTIER_BENCH_AIBRIX_CPU=1``
(this system's server). Its C extension warns about a missing ``libcuda.so.1``; harmless. Configured by environment
(``AIBRIX_KV_CACHE_OL_*``). Docs: https://aibrix.readthedocs.io and SGLang's
``python/sglang/srt/mem_cache/storage/aibrix_kvcache/README.md``.
"""

from __future__ import annotations

from benchmarks.peers.builtin import hicache_args
from benchmarks.peers.system import FLASH, Context, System

SWITCH = "KVTIER_BENCH_AIBRIX_CPU"
HOOK = '''"""Set aibrix_kvcache.cache_manager.TESTING_DISABLE_PIN_MEMORY once it is imported (no pinned memory on CPU)."""
import importlib.abc
import importlib.machinery
import sys

TARGET = "aibrix_kvcache.cache_manager"


class _NoPin(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.TESTING_DISABLE_PIN_MEMORY = True

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _NoPin())
'''


class Aibrix(System):
    name, storage = "aibrix", FLASH
    summary = "HiCache + AIBrix KV cache (L1 in DRAM = host-pool size, RocksDB L2 on flash)"
    # cityhash (its farmhash module), more-itertools and redis (the release it pins): imported by SGLang's
    # aibrix backend through aibrix_kvcache; rocksdict: its RocksDB L2
    packages = ("aibrix-kvcache", "cityhash", "more-itertools", "redis", "rocksdict")
    modules = ("aibrix_kvcache", "sglang.srt.mem_cache.storage.aibrix_kvcache.aibrix_kvcache_storage", "rocksdict")
    upstream = "https://aibrix.readthedocs.io"

    def prepare(self, ctx: Context, install: bool) -> None:
        super().prepare(ctx, install)
        (ctx.venv.site / "_kvtier_bench_aibrix_cpu.py").write_text(HOOK)
        (ctx.venv.site / "aibrix_cpu.pth").write_text(
            f"import os; os.environ.get({SWITCH!r}) == '1' and __import__('_kvtier_bench_aibrix_cpu')\n")

    def dram_store_bytes(self, ctx: Context) -> int:
        return ctx.host_pool_bytes  # its L1

    def server_args(self, ctx: Context) -> list[str]:
        return hicache_args(ctx) + ["--hicache-storage-backend", "aibrix"]

    def server_env(self, ctx: Context) -> dict[str, str]:
        return {SWITCH: "1", "AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND": "ROCKSDB",
                "AIBRIX_KV_CACHE_OL_ROCKSDB_ROOT": str(ctx.work / "rocksdb"),
                "AIBRIX_KV_CACHE_OL_L1_CACHE_CAPACITY_GB": f"{self.dram_store_bytes(ctx) / (1 << 30):.3f}"}
