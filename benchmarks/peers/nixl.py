"""NIXL as SGLang's L3 (``--hicache-storage-backend nixl``), POSIX plugin with O_DIRECT, one file per page.

Packages: ``nixl`` and its ``nixl-cu13`` wheel, both ``--no-deps`` (``libnixl.so`` and the POSIX plugin link no
CUDA; 1.5.2 pins a ``nixl-cu13`` release that was never published, so 1.5.1). No service: the store is a directory
(``SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR``); SGLang picks the POSIX plugin and opens with O_DIRECT by default
(``SGLANG_HICACHE_NIXL_USE_DIRECT_IO``). Docs: https://github.com/ai-dynamo/nixl and SGLang's
``python/sglang/srt/mem_cache/storage/nixl/README.md``.
"""

from __future__ import annotations

from benchmarks.peers.builtin import hicache_args, sglang_versions
from benchmarks.peers.system import FLASH, Context, System


class Nixl(System):
    name, storage = "nixl", FLASH
    summary = "HiCache + NIXL (POSIX plugin, O_DIRECT, one file per page)"
    packages = ("nixl", "nixl-cu13")
    modules = ("nixl._api",)
    upstream = "https://github.com/ai-dynamo/nixl"

    def server_args(self, ctx: Context) -> list[str]:
        return hicache_args(ctx) + ["--hicache-storage-backend", "nixl"]

    def server_env(self, ctx: Context) -> dict[str, str]:
        return {"SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR": str(ctx.work), "SGLANG_HICACHE_NIXL_USE_DIRECT_IO": "1"}

    def versions(self, ctx: Context) -> dict[str, str]:
        return sglang_versions() | ctx.venv.versions(self.packages)
