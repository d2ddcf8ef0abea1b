"""Soak: a real SGLang server (CPU) with sgl-kvtier under a replayed production trace for a long time.

    python -m benchmarks.soak --minutes 30          # the long run (results in benchmarks/results/soak/)
    python -m benchmarks.soak --minutes 2           # a quick look

The Mooncake FAST'25 conversation trace (--trace; see benchmarks.common.TRACE) is replayed closed-loop at
--concurrency: each 512-token prefix block id becomes a deterministic block of --block-tokens token ids (seeded by the id), so requests
that share block ids share prefixes. The store's capacity is set small (--capacity-mib) so eviction runs
all the time. Every --window seconds it records the server's memory (RSS of its whole process tree), open
file descriptors, completed requests and input tokens per second, and the store's bytes used against its
limit. Prints a table, writes JSON and a PNG; the verdict: RSS and fds flat (last window within 15% / +16
of the first after warm-up), throughput flat (last within 30% of the first), capacity never exceeded, no
request failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.common import REPO, RESULTS, TRACE, make_console, scratch_dir, write_json
from benchmarks.machine import machine_line
from benchmarks.serving.models import resolve_model
from benchmarks.serving.probes import tree_usage
from benchmarks.serving.report import pyplot, save_figure
from benchmarks.serving.session import machine
from sgl_kvtier.admin.fsck import find_shards, shard_summary
from sgl_kvtier.serving.hardware import AUTO, DTYPE_BYTES, has_cuda_gpu
from sgl_kvtier.serving.launch import BACKEND
from sgl_kvtier.serving.server import SGLangServer


def load_trace(path: Path, block_tokens: int, vocab: int, limit: int) -> list[list[int]]:
    requests, blocks = [], {}
    with open(path) as f:
        for line in f:
            ids = json.loads(line)["hash_ids"][:16]  # cap the context so a CPU prefill stays short
            for i in ids:
                if i not in blocks:
                    blocks[i] = np.random.default_rng(i).integers(10, vocab - 10, block_tokens).tolist()
            requests.append([t for i in ids for t in blocks[i]])
            if len(requests) >= limit:
                break
    return requests


def run(args: argparse.Namespace, work: Path, console: Console) -> dict:
    store = work / "flash"
    store.mkdir(parents=True, exist_ok=True)
    model = resolve_model("tiny", args.dtype, gpu=has_cuda_gpu())
    trace = load_trace(args.trace, args.block_tokens, 1024, 20_000)
    capacity = args.capacity_mib << 20
    extra = {**BACKEND, "devices": [str(store)], "capacity_bytes": capacity, "prefetch_threshold": 64}
    server_args = [*model.server_args, "--max-total-tokens", "8192", "--hicache-ratio", "2", "--enable-hierarchical-cache",
                   "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first", "--page-size", "16",
                   "--enable-cache-report", "--enable-metrics", "--skip-server-warmup",
                   "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra)]
    info = machine(model, server_args)
    windows: list[dict] = []
    done = {"requests": 0, "tokens": 0, "failed": 0, "storage_hit_tokens": 0}
    lock, stop = threading.Lock(), threading.Event()
    cursor = iter(range(10**9))

    def client(srv: SGLangServer) -> None:
        while not stop.is_set():
            with lock:
                ids = trace[next(cursor) % len(trace)]
            try:
                out = srv.generate(input_ids=ids, max_new_tokens=4)
                hit = (out["meta_info"].get("cached_tokens_details") or {}).get("storage", 0)
                with lock:
                    done["requests"] += 1
                    done["tokens"] += len(ids)
                    done["storage_hit_tokens"] += hit
            except Exception:  # noqa: BLE001 - a failed request is the finding; count it, keep soaking
                with lock:
                    done["failed"] += 1

    with SGLangServer(model.path, extra_args=server_args, log_path=work / "server.log") as srv:
        threads = [threading.Thread(target=client, args=(srv,), daemon=True) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        start = time.monotonic()
        last = dict(done)
        end = start + args.minutes * 60
        with console.status("soaking") as status:
            while time.monotonic() < end:
                stop.wait(args.window)
                rss, fds = tree_usage(srv.proc.pid)
                with lock:
                    now = dict(done)
                shard = find_shards(str(store))
                used = shard_summary(shard[0])["bytes_used"] if shard else 0
                w = {"t_s": round(time.monotonic() - start), "rss_mib": round(rss, 1), "fds": fds,
                     "req_per_s": (now["requests"] - last["requests"]) / args.window,
                     "tok_per_s": (now["tokens"] - last["tokens"]) / args.window,
                     "storage_hit_tokens": now["storage_hit_tokens"] - last["storage_hit_tokens"],
                     "store_bytes": used, "failed": now["failed"]}
                windows.append(w)
                last = now
                status.update(f"soaking: {w['t_s']} s, {now['requests']} requests, RSS {w['rss_mib']} MiB, "
                              f"fds {fds}, store {used / 2**20:.1f}/{capacity / 2**20:.0f} MiB")
        stop.set()
        for t in threads:
            t.join(timeout=60)
    return {"machine": info, "windows": windows, "totals": done, "capacity_bytes": capacity, "command": srv.command}


def verdict(result: dict) -> dict:
    w = result["windows"]
    base = w[min(1, len(w) - 1)]  # the first window includes warm-up allocation
    return {
        "rss_flat": w[-1]["rss_mib"] <= base["rss_mib"] * 1.15,
        "fds_flat": w[-1]["fds"] <= base["fds"] + 16,
        "throughput_flat": w[-1]["req_per_s"] >= base["req_per_s"] * 0.7,
        "capacity_respected": all(x["store_bytes"] <= result["capacity_bytes"] for x in w),
        "no_failed_requests": result["totals"]["failed"] == 0,
    }


def report(result: dict, out: Path, console: Console) -> None:
    table = Table(title="soak: real SGLang + sgl-kvtier under the replayed Mooncake trace")
    console.print(f"machine: {machine_line(result['machine'])}", markup=False, highlight=False)
    for col in ("t (s)", "RSS MiB", "fds", "req/s", "input tok/s", "flash hit tok", "store MiB", "failed"):
        table.add_column(col, justify="right")
    for w in result["windows"]:
        table.add_row(str(w["t_s"]), f"{w['rss_mib']:.0f}", str(w["fds"]), f"{w['req_per_s']:.2f}",
                      f"{w['tok_per_s']:.0f}", str(w["storage_hit_tokens"]), f"{w['store_bytes'] / 2**20:.1f}",
                      str(w["failed"]))
    console.print(table)
    console.print(result["verdict"])
    write_json(out / "soak.json", result)
    plt = pyplot()
    t = [w["t_s"] for w in result["windows"]]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for ax, key, label in zip(axes, ("rss_mib", "fds", "req_per_s"), ("server RSS (MiB)", "open fds", "requests/s")):
        ax.plot(t, [w[key] for w in result["windows"]], marker="o")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds")
    fig.suptitle("sgl-kvtier soak")
    save_figure(fig, out / "soak.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--window", type=float, default=30, help="seconds per sample")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per trace block (512 in production)")
    p.add_argument("--trace", type=Path, default=TRACE, help="the Mooncake conversation trace (JSON lines)")
    p.add_argument("--capacity-mib", type=int, default=24, help="store limit: small, so eviction runs")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *sorted(DTYPE_BYTES)],
                   help="model and KV dtype; auto: KVTIER_MODEL_DTYPE, else bfloat16 on a GPU or a CPU with "
                        "AVX512-BF16/AMX, else float32")
    p.add_argument("--dir", type=Path, default=REPO / ".bench-soak", help="scratch directory (removed afterwards)")
    p.add_argument("--out", type=Path, default=RESULTS / "soak")
    args = p.parse_args(argv)
    console = make_console()
    with scratch_dir(args.dir, "soak-") as work:
        result = run(args, work, console)
    result["verdict"] = verdict(result)
    report(result, args.out, console)
    return 0 if all(result["verdict"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
