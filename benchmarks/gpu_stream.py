"""The GPU mode of bench_streaming for a machine with torch but no SGLang: sgl-kvtier's store -> pinned host
memory -> GPU, per layer group, overlapped with a stand-in prefill of the suffix.

For each page geometry (``kvheavy``; ``480b-tp8``: one TP8 rank of Qwen3-Coder-480B FP8), host layout and
G in ``--groups``, the prefix's pages are written once to a ``SharedPool`` whose checksummed parts are the
G layer groups x K|V, then read back on each device setting (``fast``: the scratch directory's own device;
``breakeven``: reads throttled to prefix bytes / the measured compute time) along two paths:
(a) load-all then compute (``get`` of every page, then per-layer copies overlapped with the layers) and
(b) streamed (``get_parts`` group-major, each verified group copied and computed while the next reads).
Reported: TTFT-like seconds of each, b/a, the read, copy and compute times alone, and whether the device KV
equals the pages written. One call, bounded by ``--budget-s`` (cells not started in time are listed as
skipped). Without a GPU, ``--cpu-check`` runs the same code on CPU tensors with small hits, in seconds.

    python -m benchmarks.gpu_stream                       # on the GPU machine: results under $OUT
    python -m benchmarks.gpu_stream --cpu-check --out /tmp/x
    python -m benchmarks.gpu_stream --help

Writes <out>/gpu_stream.json, <out>/gpu_stream.md and <out>/gpu_stream.png. See docs/benchmarks/streaming.md,
section gpu_stream.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, RESULTS, can_drop_caches, drop_caches, timestamp, write_json
from benchmarks.gpu import cells, kvstore, report
from benchmarks.gpu.geometry import GEOMETRIES, Geometry

DEVICES = ("fast", "breakeven")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cpu-check", action="store_true",
                   help="CPU tensors, small hits (4 pages, 8 suffix tokens), 1 repetition: the same code, in seconds")
    p.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    p.add_argument("--layouts", nargs="+", default=["layer_first", "page_first_direct"], choices=kvstore.LAYOUTS)
    p.add_argument("--groups", nargs="+", type=int, default=[1, 4, 8], help="layer groups G of the streamed reads")
    p.add_argument("--devices", nargs="+", default=list(DEVICES), choices=DEVICES)
    p.add_argument("--breakeven-gbps", type=float,
                   help="read rate of the 'breakeven' device (GB/s), instead of prefix bytes / measured compute time")
    p.add_argument("--reps", type=int, help="repetitions per path (default 3; 1 with --cpu-check)")
    p.add_argument("--io-depth", type=int, default=32)
    p.add_argument("--budget-s", type=float, default=480.0, help="start no new cell after this many seconds")
    p.add_argument("--dir", type=Path, default=REPO / ".bench-tmp" / "gpu-stream", help="scratch (store) directory")
    p.add_argument("--out", type=Path, help="default $OUT if set, else benchmarks/results/gpu-stream-<timestamp>/")
    args = p.parse_args(argv)
    args.reps = args.reps or (1 if args.cpu_check else 3)
    env_out = os.environ.get("OUT")
    args.out = (args.out or (Path(env_out) if env_out else RESULTS / f"gpu-stream-{timestamp()}")).resolve()
    return args


def _before_read(notes: list[str]) -> Any:
    """Drop the page cache before each read where allowed (kvtier reads with O_DIRECT where it can anyway)."""
    allowed = [can_drop_caches()]

    def run() -> None:
        if allowed[0]:
            try:
                drop_caches()
            except OSError as exc:
                allowed[0] = False
                notes.append(f"page cache not dropped: {exc}")

    return run


def geometry_record(g: Geometry) -> dict[str, Any]:
    return {"note": g.note, "layers": g.layers, "page_tokens": g.page_tokens, "page_bytes": g.page_bytes,
            "prefix_tokens": g.prefix_tokens, "prefix_bytes": g.prefix_bytes, "suffix_tokens": g.suffix_tokens,
            "kv_dtype": g.kv_dtype, "layer_gflop": g.layer_flops() / 1e9}


def run_geometry(args: argparse.Namespace, geom: Geometry, device: Any, dtype: Any, result: dict[str, Any],
                 t_start: float, before_read: Any) -> None:
    import torch

    from benchmarks.gpu.kvstore import DeviceKV, HostKV
    from benchmarks.gpu.pipeline import Sync, compute_only
    from benchmarks.gpu.prefill import StandIn

    sync, model, kv = Sync(device), StandIn(geom, device, dtype), DeviceKV(geom, device)
    canonical = kvstore.canonical_pages(geom, device=device)  # the pages to write, and what a load must give
    expected = canonical.reshape(2, geom.layers, -1)
    kv.data.copy_(expected)
    compute_only(model, kv, sync)  # warm-up: kernels chosen, handles made, weights touched, GQA path decided
    result["geometries"][geom.name]["attention"] = model.gqa
    keys = kvstore.page_keys(geom, geom.pages)
    rate: float | None = None  # the break-even read rate, from this geometry's first fast cell
    for layout in args.layouts:
        host = HostKV(geom, layout, pin=device.type == "cuda")
        for g in args.groups:
            plan = geom.plan(min(g, geom.layers))
            root = args.dir / f"{geom.name}-{layout}-g{plan.group_count}"
            shutil.rmtree(root, ignore_errors=True)
            host.fill(canonical)
            with kvstore.open_pool(root, geom, plan, layout, io_depth=args.io_depth) as pool:
                stored = kvstore.write_pages(pool, keys, host)
                result["direct_io"] = pool.stats().direct_io
            for dev in args.devices:
                cell: dict[str, Any] = {"geometry": geom.name, "layout": layout, "device": dev,
                                        "groups": plan.group_count, "bounds": list(plan.bounds)}
                result["cells"].append(cell)
                if stored != geom.pages:
                    cell["skipped"] = f"only {stored} of {geom.pages} pages stored"
                    continue
                if time.monotonic() - t_start > args.budget_s:
                    cell["skipped"] = "time budget"
                    continue
                throttle = None
                if dev == "breakeven":
                    be = result["breakeven"].get(geom.name)
                    if rate is None or be is None:
                        cell["skipped"] = "no fast cell measured the compute time first"
                        continue
                    if "note" in be:  # the device is slower than break-even already: a throttle cannot bind
                        cell["skipped"] = "fast is below break-even"
                        continue
                    throttle = rate
                with kvstore.open_pool(root, geom, plan, layout, throttle, args.io_depth) as pool:
                    cell |= cells.run_cell(pool, keys, host, kv, model, sync, plan, expected, args.reps, before_read)
                m = cell["median"]
                if dev == "fast" and rate is None:
                    given = args.breakeven_gbps is not None
                    rate = args.breakeven_gbps * 1e9 if given else cells.breakeven_rate(geom, m["compute_s"])
                    fast_rate = geom.prefix_bytes / m["read_s"]
                    result["breakeven"][geom.name] = {"compute_s": m["compute_s"], "read_bytes_per_s": rate,
                                                      "fast_read_bytes_per_s": fast_rate,
                                                      "source": "given (--breakeven-gbps)" if given else "derived"}
                    if fast_rate < rate and not given:  # a throttle could not slow this device down
                        result["breakeven"][geom.name]["note"] = (
                            f"the fast device reads at {fast_rate / 1e9:.2f} GB/s, already below break-even "
                            f"({rate / 1e9:.2f} GB/s): no breakeven cells")
                print(" | ".join(report.row(cell)), flush=True)
            shutil.rmtree(root, ignore_errors=True)
        del host
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = sys.argv if argv is None else argv
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_check
    if not cuda and not args.cpu_check:
        print("no CUDA GPU here: run with --cpu-check (the same code on CPU tensors)", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if args.cpu_check:  # a CPU check is of the code path: one thread, so busy cores cannot stall its spin-waits
        torch.set_num_threads(1)
    try:
        return _run(args, cuda)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, cuda: bool) -> int:
    import torch

    from benchmarks.machine import machine_info

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    args.out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    result: dict[str, Any] = {
        "started": timestamp(), "argv": args.argv,
        "mode": "GPU" if cuda else "CPU check (CPU tensors, small hits)", "compute_dtype": str(dtype).split(".")[-1],
        "reps": args.reps, "machine": machine_info(str(dtype).split(".")[-1], path=REPO, probe=not args.cpu_check,
                                                   dtype_source="the stand-in prefill's compute dtype"),
        "page_cache": "dropped before every read" if can_drop_caches() else "not dropped (not root)",
        "geometries": {}, "breakeven": {}, "cells": [], "notes": notes,
    }  # fmt: skip
    t_start = time.monotonic()
    before_read = _before_read(notes)
    failed = 0
    try:
        for name in args.geometries:
            geom = GEOMETRIES[name].for_cpu_check() if args.cpu_check else GEOMETRIES[name]
            result["geometries"][name] = geometry_record(geom)
            try:
                run_geometry(args, geom, device, dtype, result, t_start, before_read)
            except Exception as exc:  # noqa: BLE001 - one broken geometry must not lose the others
                failed += 1
                notes.append(f"{name} failed: {type(exc).__name__}: {exc}"[:2000])
                print(f"{name} failed: {exc!r}", file=sys.stderr, flush=True)
            write_json(args.out / "gpu_stream.json", result)
    finally:
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        write_json(args.out / "gpu_stream.json", result)
        md = report.markdown(result)
        (args.out / "gpu_stream.md").write_text(md)
        report.plot(result, args.out)
        print(md, flush=True)
        shutil.rmtree(args.dir, ignore_errors=True)
    bad = [c for c in result["cells"] if not c.get("skipped") and not (c.get("ok") and c.get("verified"))]
    return 1 if failed or bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
