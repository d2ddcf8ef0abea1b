"""What landing one L3 hit costs the CPU: read whole vs streamed in N read groups.

    python -m benchmarks.bench_landing                              # kvheavy float32 geometry, 96 pages (201 MB)
    python -m benchmarks.bench_landing --read-groups 8 4 2 --rounds 5
    python -m benchmarks.bench_landing --io-engine uring            # where liburing's probe passes

SGLang's real MHA host pool (``layer_first``, 16-token pages, 64 layers x 4 KV heads x 64 in float32: ``kvheavy``'s
pages, 2 MiB each) and our real backend (``KVTierStorage``, ``streaming = "on"``, read-ahead off) on ``--dir``.
Each round, with the page cache dropped before each read: the hit read whole (``batch_get_v1``, the whole-load
path), then for each ``--read-groups`` count bound and streamed (``StreamBinder.bind``, waited to its end).
Measured: wall seconds and this process's CPU seconds (``getrusage``: every thread, the IO threads' syscalls and
hashing included). IOs: one per page read whole; one per page, K|V range and read group streamed.

On a CPU engine the landing of a streamed tail runs on the cores its forward computes on, so its CPU is the
forward's delay; ``CPU per IO`` (the extra CPU of a streamed read over the whole read of the same round, per
extra IO) is the figure ``experiments.streaming.rules.read_groups`` weighs (``OP_CPU_S``). Results: ``--out`` (JSON) and a table.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from benchmarks.common import (
    RESULTS,
    args_json,
    can_drop_caches,
    drop_caches,
    make_console,
    scratch_dir,
    store_room,
    write_json,
)
from benchmarks.machine import machine_info, machine_line
from sgl_kvtier.config import IOEngineName
from sgl_kvtier.experiments.streaming.backend_side import install, require_side
from sgl_kvtier.experiments.streaming.rules.read_groups import even_cuts
from sgl_kvtier.keys import parse_keys
from sgl_kvtier.sglang import KVTierStorage

console = make_console()
PAGE_TOKENS = 16


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pages", type=int, default=96, help="pages per hit (96 x 2 MiB = 201 MB)")
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--read-groups", type=int, nargs="+", default=[8, 4, 2], help="read-group counts streamed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--io-engine", default=IOEngineName.AUTO.value, choices=[e.value for e in IOEngineName],
                   help="the store's io_engine (uring only where its probe passes on the machine)")
    p.add_argument("--dir", type=Path, default=Path(".bench-landing"), help="scratch parent (the store)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_landing.json")
    return p.parse_args(argv)


def host_pool(args: argparse.Namespace) -> MHATokenToKVPoolHost:
    """SGLang's host pool with room for three hits (the stored one, one read whole, one streamed), random bytes."""
    tokens = (args.pages + 1) * PAGE_TOKENS
    device = MHATokenToKVPool(tokens, PAGE_TOKENS, torch.float32, args.kv_heads, args.head_dim, args.layers, "cpu",
                              False, start_layer=0, end_layer=args.layers - 1)
    pool = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 3.0, 0, PAGE_TOKENS, "layer_first",
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                                end_layer=args.layers - 1)
    pool.bench_device_pool = device  # the buffers its buffer info points at stay alive
    pool.kv_buffer.view(torch.int32).random_(generator=torch.Generator().manual_seed(7))
    return pool


def backend_on(root: Path, pool: MHATokenToKVPoolHost, nbytes: int, io_engine: str = "auto") -> KVTierStorage:
    extra = {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang", "class_name": "KVTierStorage",
             "io_engine": io_engine, "interface_v1": 1, "devices": [str(root)], "capacity_bytes": store_room(nbytes),
             "readahead_bytes": 0, "streaming": "on", "model_fingerprint": "bench-landing"}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                               model_name="bench/landing", extra_config=extra)
    install()  # the stream plugin's streaming side on this backend (as KVTIER_STREAM=1 would)
    backend = KVTierStorage(cfg, {})
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def slots(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE_TOKENS, (first_page + pages) * PAGE_TOKENS, dtype=torch.int64)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(read: Any, cold: bool) -> tuple[float, float]:
    """(wall s, CPU s) of ``read()``, the page cache dropped first when ``cold``."""
    if cold:
        drop_caches()
    c0, t0 = cpu_s(), time.perf_counter()
    read()
    return time.perf_counter() - t0, cpu_s() - c0


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    pool = host_pool(args)
    page_bytes = 2 * args.layers * PAGE_TOKENS * args.kv_heads * args.head_dim * 4  # K and V, float32
    backend = backend_on(root, pool, args.pages * page_bytes, args.io_engine)
    try:
        plan = backend.kv.pages.plan
        if plan is None:
            raise SystemExit("this pool does not stream in layer groups")
        keys = [hashlib.sha256(f"landing-{i}".encode()).hexdigest() for i in range(args.pages)]
        # The streams' slots stay bound to their (ended) stream until the next bind: the whole reads go elsewhere,
        # or the binder would answer them.
        src, dst, whole_dst = (slots(1 + n * args.pages, args.pages) for n in range(3))
        if backend.batch_set_v1(keys, src) != [True] * args.pages:
            raise SystemExit("the hit was not stored")
        cold = can_drop_caches()
        gc.collect()
        gc.freeze()  # as every server the runner starts (``SGLangServer._freeze_gc``): no full collection of set-up

        def whole() -> None:
            if backend.batch_get_v1(keys, whole_dst) != [True] * args.pages:
                raise SystemExit("the whole read missed")

        def streamed(g: int) -> Any:
            def read() -> None:
                stream = require_side(backend).binder.bind(parse_keys(keys), dst, cuts=even_cuts(plan.group_count, g))
                if stream is None or not stream.wait_ended(600) or stream.landed_pages() != args.pages:
                    raise SystemExit(f"the stream in {g} read groups did not land")
            return read

        groups = [max(1, min(g, plan.group_count)) for g in args.read_groups]
        rows: list[dict[str, Any]] = []
        with console.status("landing") as status:
            for r in range(args.rounds):
                status.update(f"round {r + 1}/{args.rounds}: whole")
                base_wall, base_cpu = measure(whole, cold)
                rows.append({"round": r, "path": "whole", "read_groups": None, "ios": args.pages,
                             "wall_s": base_wall, "cpu_s": base_cpu})
                for g in groups:
                    status.update(f"round {r + 1}/{args.rounds}: {g} read groups")
                    wall, cpu = measure(streamed(g), cold)
                    ios = args.pages * plan.ranges * g
                    rows.append({"round": r, "path": "streamed", "read_groups": g, "ios": ios, "wall_s": wall,
                                 "cpu_s": cpu, "cpu_ratio": cpu / base_cpu if base_cpu > 0 else None,
                                 "cpu_per_io_s": (cpu - base_cpu) / (ios - args.pages) if ios > args.pages else None})
        return {"hit_bytes": args.pages * plan.page_bytes, "stored_groups": plan.group_count, "cold": cold,
                "rows": rows}
    finally:
        backend.close()


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per path: medians over the rounds."""
    out = []
    for key in dict.fromkeys((row["path"], row["read_groups"]) for row in result["rows"]):
        rows = [row for row in result["rows"] if (row["path"], row["read_groups"]) == key]
        per_io = [row["cpu_per_io_s"] for row in rows if row.get("cpu_per_io_s") is not None]
        ratios = [row["cpu_ratio"] for row in rows if row.get("cpu_ratio") is not None]
        out.append({"path": key[0], "read_groups": key[1], "ios": rows[0]["ios"],
                    "wall_s": statistics.median(row["wall_s"] for row in rows),
                    "cpu_s": statistics.median(row["cpu_s"] for row in rows),
                    "cpu_ratio": statistics.median(ratios) if ratios else None,
                    "cpu_per_io_s": statistics.median(per_io) if per_io else None})
    return out


def table(rows: list[dict[str, Any]], hit_bytes: int, engine: str = "auto") -> Table:
    t = Table(title=f"landing one {hit_bytes / 1e6:.0f} MB hit, io_engine {engine} (medians over the rounds)")
    for col in ("path", "IOs", "wall s", "CPU s", "CPU / whole", "CPU per extra IO"):
        t.add_column(col, justify="right")
    for row in rows:
        name = "whole" if row["path"] == "whole" else f"streamed, {row['read_groups']} read groups"
        t.add_row(name, str(row["ios"]), f"{row['wall_s']:.3f}", f"{row['cpu_s']:.3f}",
                  "-" if row["cpu_ratio"] is None else f"{row['cpu_ratio']:.2f}",
                  "-" if row["cpu_per_io_s"] is None else f"{row['cpu_per_io_s'] * 1e3:.3f} ms")
    return t


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    info = machine_info("float32", args.dir if args.dir.exists() else None, dtype_source="forced: KV pages in float32")
    console.print(machine_line(info))
    with scratch_dir(args.dir, "landing-") as root:
        result = run(args, root)
    result["summary"] = summary(result)
    result.update(args=args_json(args), machine=info)
    console.print(table(result["summary"], result["hit_bytes"], args.io_engine))
    if not result["cold"]:
        console.print("[yellow]page cache not dropped (not root): reads were warm[/]")
    console.print(f"results: {write_json(args.out, result)}")
    return result


if __name__ == "__main__":
    main()
