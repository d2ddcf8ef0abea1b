"""Mooncake Store as SGLang's L3 (``--hicache-storage-backend mooncake``): a DRAM pool, and the same with SSD offload.

Package: ``mooncake-transfer-engine-non-cuda`` (the plain ``mooncake-transfer-engine`` wheel's store client links
libcuda). Service: ``mooncake_master`` with its built-in HTTP metadata server (no etcd). The memory segment (the
DRAM pool, ``global_segment_size``) lives in the SGLang process, so it is in the server's cgroup and counted as its
DRAM store. SSD offload: the master's ``--enable_offload``, the client's ``enable_ssd_offload`` / ``ssd_offload_path``;
with the default bucket storage backend nothing reaches the disk (the master only logs "objects deferred for disk
offload", https://github.com/kvcache-ai/Mooncake/issues/3006), so the per-key file backend is selected
(``MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR``). Docs: https://kvcache-ai.github.io/Mooncake/ and SGLang's
``python/sglang/srt/mem_cache/storage/mooncake_store/README.md``.
"""

from __future__ import annotations

import json
import math

from benchmarks.peers.builtin import hicache_args
from benchmarks.peers.system import DRAM, FLASH, Context, Service, System, tcp_open
from sgl_kvtier.serving import client

PACKAGE = "mooncake-transfer-engine-non-cuda"
MIN_SEGMENT = 16 << 20
# The master's gauges (its /metrics) kept per phase: what its segments hold, and what they can hold.
METRICS = {"master_allocated_bytes": "dram_allocated_bytes", "master_total_capacity_bytes": "dram_capacity_bytes"}


def whole_mib(nbytes: int) -> int:
    """``global_segment_size`` in bytes, whole MiB (SGLang's parser takes an int or whole ``"<n>gb"`` only)."""
    return max(1, math.ceil(nbytes / (1 << 20))) << 20


class MooncakeDram(System):
    name, storage = "mooncake-dram", DRAM
    summary = "HiCache + Mooncake Store, DRAM pool (segment in the SGLang process, mooncake_master beside it)"
    packages = (PACKAGE,)
    modules = ("mooncake.store",)
    tools = ("mooncake_master",)
    upstream = "https://kvcache-ai.github.io/Mooncake/"
    offload = False

    def segment_bytes(self, ctx: Context) -> int:
        """The DRAM pool: room for the whole working set plus a quarter (nothing evicted) in DRAM mode; in offload
        mode the host pool's size, so the working set must spill to the SSD (at least 16 MiB: the client refuses a
        smaller segment, "Total size must be at least 16777216")."""
        if self.offload:
            return max(ctx.host_pool_bytes, MIN_SEGMENT)
        return ctx.working_set_bytes * 5 // 4 + 64 * (1 << 20)

    def dram_store_bytes(self, ctx: Context) -> int:
        return whole_mib(self.segment_bytes(ctx))

    def readings(self, ctx: Context) -> dict[str, float]:
        """The master's allocated and total segment bytes (the DRAM pool in use, and its size)."""
        samples = client.scrape(f"http://127.0.0.1:{ctx.port('metrics')}", timeout_s=5.0)
        return {METRICS[name]: value for name, labels, value in samples if name in METRICS and not labels}

    def services(self, ctx: Context) -> list[Service]:
        rpc, http = ctx.port("rpc"), ctx.port("http")
        cmd = [str(ctx.venv.bin / "mooncake_master"), "--enable_http_metadata_server=true",
               f"--http_metadata_server_port={http}", f"--rpc_port={rpc}", f"--metrics_port={ctx.port('metrics')}",
               "--eviction_high_watermark_ratio=0.95"]
        if self.offload:
            cmd.append("--enable_offload=true")
        return [Service("mooncake_master", cmd, ctx.log_dir / f"{self.name}-master.log",
                        lambda: tcp_open("127.0.0.1", rpc) and tcp_open("127.0.0.1", http),
                        env=self.server_env(ctx), cwd=ctx.work)]

    def extra_config(self, ctx: Context) -> dict[str, object]:
        extra: dict[str, object] = {
            "master_server_address": f"127.0.0.1:{ctx.port('rpc')}", "local_hostname": "localhost",
            "metadata_server": f"http://127.0.0.1:{ctx.port('http')}/metadata",
            "global_segment_size": whole_mib(self.segment_bytes(ctx)), "protocol": "tcp", "device_name": "",
        }  # fmt: skip
        if self.offload:
            extra |= {"enable_ssd_offload": True, "ssd_offload_path": str(ctx.work / "ssd")}
        return extra

    def server_args(self, ctx: Context) -> list[str]:
        if self.offload:
            (ctx.work / "ssd").mkdir(parents=True, exist_ok=True)
        return hicache_args(ctx) + ["--hicache-storage-backend", "mooncake",
                                    "--hicache-storage-backend-extra-config", json.dumps(self.extra_config(ctx))]

    def server_env(self, ctx: Context) -> dict[str, str]:
        # the per-key file backend: the default bucket backend defers every object and writes nothing
        return {"MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "file_per_key_storage_backend"} if self.offload else {}


class MooncakeSsd(MooncakeDram):
    name, storage, offload = "mooncake-ssd", FLASH, True
    summary = "HiCache + Mooncake Store with SSD offload (segment = host-pool size, file-per-key offload)"

