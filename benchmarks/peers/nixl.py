"""NIXL as SGLang's L3 (``--hicache-storage-backend nixl``), POSIX plugin with O_DIRECT, one file per page.

Packages: ``nixl`` and its ``nixl-cu13`` wheel, both ``--no-deps`` (``libnixl.so`` and the POSIX plugin link no
CUDA; 1.5.2 pins a ``nixl-cu13`` release that was never published, so 1.5.1). No service: the store is a directory
(``SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR``); SGLang picks the POSIX plugin and opens with O_DIRECT by default
(``SGLANG_HICACHE_NIXL_USE_DIRECT_IO``). SGLang's L3 cleaner for NIXL's files is switched off
(``l3_cleaner_enabled``): it deletes the store's oldest files whenever the whole filesystem is over 80 % full
(reserved blocks counted), so on a disk shared with other data NIXL's hits would follow that data, not the
workload; the other file-based systems keep what they write too. Docs: https://github.com/ai-dynamo/nixl and SGLang's
``python/sglang/srt/mem_cache/storage/nixl/README.md``.
"""

from __future__ import annotations

import json

from benchmarks.peers.builtin import hicache_args
from benchmarks.peers.system import FLASH, Context, System


class Nixl(System):
    name, storage = "nixl", FLASH
    summary = "HiCache + NIXL (POSIX plugin, O_DIRECT, one file per page)"
    packages = ("nixl", "nixl-cu13")
    modules = ("nixl._api",)
    upstream = "https://github.com/ai-dynamo/nixl"

    def server_args(self, ctx: Context) -> list[str]:
        return hicache_args(ctx) + ["--hicache-storage-backend", "nixl", "--hicache-storage-backend-extra-config",
                                    json.dumps({"l3_cleaner_enabled": False})]

    def server_env(self, ctx: Context) -> dict[str, str]:
        return {"SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR": str(ctx.work), "SGLANG_HICACHE_NIXL_USE_DIRECT_IO": "1"}
