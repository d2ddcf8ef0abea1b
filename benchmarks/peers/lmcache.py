"""LMCache as SGLang's KV cache connector (``--enable-lmcache``): it replaces HiCache (no SGLang host pool), and a
standalone ``lmcache server`` daemon owns the cache: an L1 in DRAM (as large as the host pool of the HiCache
systems, so the DRAM each holds is alike) and an L2 on the flash (``fs`` adapter, files in the system's directory).

Package: ``lmcache`` with ``--no-deps`` plus the pure-Python modules it imports that the project's venv lacks; no
CUDA ops are needed (it picks a CPU device). The daemon needs ``--supported-transfer-mode auto`` (else "No handler
registered for operation register_kv_cache_engine_driven_context") and ``--disable-observability`` (else a missing
OpenTelemetry exporter). Only whole 256-token chunks are stored. Docs: https://docs.lmcache.ai and SGLang's
``python/sglang/srt/mem_cache/storage/lmcache/README.md``.
"""

from __future__ import annotations

import json

from benchmarks.peers.builtin import radix_args
from benchmarks.peers.system import FLASH, Context, Service, System, tcp_open


class LMCache(System):
    # l3 False: its stores go to its daemon, past SGLang's HiCache backup counter, which stays at 0; waiting on
    # that counter would only run out --backup-wait before every phase
    name, storage, hicache, l3 = "lmcache", FLASH, False, False
    summary = "LMCache connector (replaces HiCache): lmcache server daemon, L1 DRAM = host-pool size, L2 fs on flash"
    # py-cpuinfo and cachetools: the daemon's CLI (without them it is the "lightweight" CLI with no `server`);
    # aiofiles: the fs L2 adapter (without it the type "fs" is unknown); blake3: the daemon's token hasher
    packages = ("lmcache", "py-cpuinfo", "cachetools", "aiofiles", "blake3")
    modules = ("lmcache", "cpuinfo", "cachetools", "blake3", "lmcache.v1.distributed.l2_adapters.fs_l2_adapter")
    tools = ("lmcache",)
    upstream = "https://docs.lmcache.ai"

    def dram_store_bytes(self, ctx: Context) -> int:
        return ctx.host_pool_bytes  # its L1, in the daemon

    def services(self, ctx: Context) -> list[Service]:
        port = ctx.port("mp")
        l2 = ctx.work / "l2"
        l2.mkdir(parents=True, exist_ok=True)
        cmd = [str(ctx.venv.bin / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
               "--http-port", str(ctx.port("http")), "--l1-size-gb", f"{self.dram_store_bytes(ctx) / (1 << 30):.3f}",
               "--eviction-policy", "LRU", "--disable-observability", "--supported-transfer-mode", "auto",
               "--l2-adapter", json.dumps({"type": "fs", "base_path": str(l2)})]
        return [Service("lmcache server", cmd, ctx.log_dir / f"{self.name}-daemon.log",
                        lambda: tcp_open("127.0.0.1", port), cwd=ctx.work, timeout_s=180.0)]

    def server_args(self, ctx: Context) -> list[str]:
        cfg = ctx.work / "lmcache.yaml"
        cfg.write_text(f"mp_host: 127.0.0.1\nmp_port: {ctx.port('mp')}\n")
        return radix_args(ctx) + ["--enable-lmcache", "--lmcache-config-file", str(cfg)]
