"""Store-level comparison: sgl-kvtier vs SGLang's ``file`` backend vs fio, same pages, same directory, same run.

Both backends are made and driven as SGLang's HiCache controller makes and drives them
(``benchmarks.store.backends``), in 128-page batches from/to scattered host slots. Every page read back is
compared with the page written; a mismatch fails the run. With ``--readahead`` it also times kvtier's
exists -> get span (``benchmarks.store.load``) with read-ahead on (``--readahead-bytes``) and off.

Regenerate benchmarks/results/bench_backends.json (as root, so the page cache can be dropped before cold reads):

    python -m benchmarks.bench_backends --page-mib 2 8 --total-gib 2 --rounds 3 \
        --io-depth 32 --layout page_first_direct --dir ./.bench-store --readahead

Rows and how to read them: docs/benchmarks/backends.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from rich.markup import escape
from rich.table import Table
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from benchmarks.common import RESULTS, make_console, median
from benchmarks.machine import machine_line
from benchmarks.store.backends import (
    close,
    host_pool,
    make_backend,
    page_equal,
    slot_indices,
    zero_pages,
)
from benchmarks.store.context import BATCH, Ctx, store_run, write_result
from benchmarks.store.fio import measure_fio
from benchmarks.store.load import READAHEAD_ON, measure_loads
from sgl_kvtier.config import MiB
from sgl_kvtier.serving.hardware import AUTO, DTYPE_BYTES, choose_dtype

SYSTEMS = ("file", "kvtier")
ORDER = ("file", "kvtier", "kvtier+ra", "fio")  # table rows
OPS = ("put", "get", "load", "exists cold", "exists warm")
TARGET = 5.0  # kvtier >= 5x file, reads and writes
console = make_console()


@dataclass
class Row:
    metric: str
    system: str  # file / kvtier / kvtier+ra / fio
    op: str  # put / get / load / exists cold / exists warm
    page_mib: float
    unit: str  # GB/s (higher is better) or ms (lower is better)
    samples: list[float] = field(default_factory=list)
    note: str = ""
    vs_file: float | None = None  # speedup over file (for ms rows: file ms / this ms)
    vs_fio: float | None = None
    vs_ra_off: float | None = None  # load rows with read-ahead: GB/s over the same span with read-ahead off
    target: str = ""
    passed: bool | None = None

    value = property(lambda self: median(self.samples))


def write_then_read(ctx: Ctx, kind: str, label: str, opener, keys: list[str], src: list, pool) -> dict:
    """Write every page (128 per call), reopen after dropping caches, batch_exists cold/warm, read back and
    verify; the put/get/exists figures (seconds) and notes."""
    args, nbatch = ctx.args, len(src)
    backend, io = opener()
    try:
        task, put_s = ctx.task(f"{label} put", nbatch), 0.0
        for b in range(nbatch):
            t0 = time.perf_counter()
            ok = io.set(keys[b * BATCH:(b + 1) * BATCH], slot_indices(src[b]), HiCacheStorageExtraInfo(prefix_keys=None))
            put_s += time.perf_counter() - t0
            if not ok:
                raise RuntimeError(f"{label}: batch {b} was not stored")
            ctx.step(task)
        t0 = time.perf_counter()
        os.sync()  # untimed in put; reported in the note (file does not fsync, kvtier fdatasyncs every call)
        sync_s = time.perf_counter() - t0
        path_note = "zero-copy v1" if io.zero_copy else "legacy copy path"
        if kind == "kvtier":
            path_note += f", engine={backend.kv.store.stats().engine}"
        close(backend)
        ctx.drop_caches()
        backend, io = opener()  # as after a restart
        query = keys[:args.exists_keys]
        t0 = time.perf_counter()
        hit = backend.batch_exists(query)
        cold_ms = (time.perf_counter() - t0) * 1e3
        warm_ms = []
        for _ in range(args.exists_repeats):
            t0 = time.perf_counter()
            hit = min(hit, backend.batch_exists(query))
            warm_ms.append((time.perf_counter() - t0) * 1e3)
        if hit != len(query):
            raise RuntimeError(f"{label}: batch_exists found {hit} of {len(query)} stored keys")
        task, get_s = ctx.task(f"{label} get", nbatch), 0.0
        for b in range(nbatch):  # data still cold: exists touched metadata only, as the controller's prefetch does
            dst = ctx.rng.permutation(BATCH) + 2 * BATCH  # scattered landing slots, zeroed first
            zero_pages(pool, dst)
            t0 = time.perf_counter()
            got = io.get(keys[b * BATCH:(b + 1) * BATCH], slot_indices(dst), HiCacheStorageExtraInfo(prefix_keys=None))
            get_s += time.perf_counter() - t0
            if got != BATCH:
                raise RuntimeError(f"{label}: batch {b} returned {got} of {BATCH} pages")
            bad = [i for i in range(BATCH) if not page_equal(pool, int(dst[i]), int(src[b][i]))]
            if bad:
                raise RuntimeError(f"{label}: batch {b}: {len(bad)} pages read back differ from what was written")
            ctx.step(task)
    finally:
        close(backend)
    return {"put_s": put_s, "sync_s": sync_s, "get_s": get_s, "exists cold": cold_ms,
            "exists warm": statistics.median(warm_ms), "exists_keys": len(query), "path_note": path_note}


def measure_backend(ctx: Ctx, kind: str, page_mib: float, pool, rnd: int) -> dict:
    """One backend at one page size: put/get/exists figures, and with ``--readahead`` kvtier's load spans."""
    page_bytes = int(page_mib * MiB)
    nbatch = ctx.batches(page_bytes)
    nbytes, path = ctx.pass_bytes(page_bytes), ctx.root / kind
    path.mkdir()
    keys = [os.urandom(32).hex() for _ in range(nbatch * BATCH)]
    src = [ctx.rng.permutation(2 * BATCH)[:BATCH] for _ in range(nbatch)]  # scattered source pages per batch
    opener = partial(make_backend, kind, path, pool, nbytes, ctx.args.io_depth, ctx.args.layout)
    try:
        res = write_then_read(ctx, kind, f"{kind} {page_mib:g} MiB", opener, keys, src, pool)
        if kind == "kvtier" and ctx.args.readahead:
            res["loads"] = measure_loads(ctx, opener, keys, src[-1], pool, nbytes, reverse=rnd % 2 == 1)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    note = res["path_note"]
    return {**res, "put": nbytes / res["put_s"] / 1e9, "get": nbytes / res["get_s"] / 1e9, "get_note":
            note + ", verified byte-exact", "put_note": note + (", fdatasync per call" if kind == "kvtier" else
            f", no fsync (with a trailing sync: {nbytes / (res['put_s'] + res['sync_s']) / 1e9:.2f} GB/s)")}


def run_all(ctx: Ctx, rows: dict[tuple, Row]) -> None:
    pools, systems = {}, [s for s in SYSTEMS if s in ctx.args.systems]
    for rnd in range(ctx.args.rounds):
        for mib in ctx.args.page_mib:
            if mib not in pools:
                # 2 batches of sources, 1 of landing slots
                pools[mib] = host_pool(mib, ctx.args.layout, 3 * BATCH, getattr(torch, ctx.args.kv_dtype))
            page_bytes = int(mib * MiB)
            measure_fio(ctx, page_bytes)
            for op, rw in (("put", "write"), ("get", "read")):
                add(rows, "fio", op, mib, "GB/s", ctx.fio[page_bytes][rw], f"engine={ctx.fio[page_bytes]['engine']}, "
                    f"bs={mib:g} MiB, iodepth={ctx.args.io_depth}, O_DIRECT" + (", end_fsync" if rw == "write" else ""))
            for kind in (systems if rnd % 2 == 0 else systems[::-1]):  # alternate who goes first
                res = measure_backend(ctx, kind, mib, pools[mib], rnd)
                for op in ("put", "get"):
                    add(rows, kind, op, mib, "GB/s", res[op], res[f"{op}_note"])
                for op in ("exists cold", "exists warm"):
                    add(rows, kind, op, mib, "ms", res[op], f"{res['exists_keys']:,} keys, all present"
                        + (f"; median of {ctx.args.exists_repeats}" if op == "exists warm" else "; first call after reopen"))
                for system, load in res.get("loads", {}).items():
                    add(rows, system, "load", mib, "GB/s", load["load"], load["note"])


def add(rows: dict, system: str, op: str, mib: float, unit: str, value: float, note: str) -> None:
    row = rows.setdefault((mib, op, system), Row(f"{system} {op} {mib:g} MiB", system, op, mib, unit))
    row.samples.append(value)
    row.note = note


def judge(rows: dict[tuple, Row], cold: bool) -> list[Row]:
    for (mib, op, system), row in rows.items():
        if op in ("get", "load") and system != "fio":
            row.metric = f"{system} {op} {'cold' if cold else 'WARM'} {mib:g} MiB"
        base, fio = rows.get((mib, op, "file")), rows.get((mib, "get" if op == "load" else op, "fio"))
        if base and base.value and row.value:
            row.vs_file = row.value / base.value if row.unit == "GB/s" else base.value / row.value
        if fio and fio.value and row.value and row.unit == "GB/s":
            row.vs_fio = row.value / fio.value
        off = rows.get((mib, op, "kvtier"))
        if system == "kvtier+ra" and off and off.value and row.value:
            row.vs_ra_off = row.value / off.value
        if system == "kvtier" and op in ("put", "get") and base:
            row.target, row.passed = f">= {TARGET:g}x file", (row.vs_file or 0) >= TARGET
    return sorted(rows.values(), key=lambda r: (OPS.index(r.op) > 2, r.page_mib, OPS.index(r.op), ORDER.index(r.system)))


def print_table(rows: list[Row], cold: bool, machine: str) -> None:
    table = Table(title="sgl-kvtier vs SGLang `file` vs fio (same pages, same directory, same run; medians over "
                        f"rounds){'' if cold else ' -- READS WARM: not root'}")
    console.print(f"machine: {machine}", markup=False, highlight=False)
    for col in ("metric", "value", "vs file", "vs fio", "vs ra off", "target", "pass/fail", "note"):
        table.add_column(col, justify="left" if col in ("metric", "note") else "right")
    for r in rows:
        verdict = {True: "[green]PASS", False: "[red]FAIL", None: "-"}[r.passed]
        table.add_row(escape(r.metric), f"{r.value:.3f} {r.unit}" if r.value is not None else "-", *(f"{v:.2f}x" if v else "-" for v in (r.vs_file, r.vs_fio, r.vs_ra_off)), r.target or "-", verdict, escape(r.note))
    console.print(table)
    console.print("vs file = speedup over SGLang's file backend (for ms rows: file ms / this ms); vs fio = GB/s / "
                  "fio GB/s at the same bs and iodepth (load rows: fio read); vs ra off = kvtier's exists -> get span "
                  "with read-ahead at its default over the same span with read-ahead off.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-mib", type=float, nargs="+", default=[2, 8], help="page sizes, multiples of 0.25 (default: 2 8)")
    p.add_argument("--total-gib", type=float, default=2.0, help="GiB written and read per backend, page size and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (fio, file, kvtier); rows show medians (default: 3)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS, help="backends to measure")
    p.add_argument("--io-depth", type=int, default=32, help="kvtier io_depth and fio --iodepth (default: 32)")
    p.add_argument("--layout", default="page_first_direct", choices=["page_first_direct", "page_first", "layer_first"])
    p.add_argument("--exists-keys", type=int, default=1000, help="keys per batch_exists call (at most the pages written)")
    p.add_argument("--exists-repeats", type=int, default=20, help="warm batch_exists calls (default: 20)")
    p.add_argument("--readahead", action="store_true",
                   help="also time kvtier's exists -> get span with read-ahead on (--readahead-bytes) and off")
    p.add_argument("--readahead-bytes", type=int, default=READAHEAD_ON,
                   help="with --readahead: the read-ahead budget measured against 0 (default: 256 MiB)")
    p.add_argument("--load-gap-ms", type=float, default=0.0,
                   help="with --readahead: ms between the exists calls and the first get, standing for the "
                        "scheduler step SGLang runs in between (default: 0)")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *sorted(DTYPE_BYTES)],
                   help="KV dtype of the host pool (the same bytes per page and layer in every dtype); auto: the "
                        "machine's native one, as the serving benchmarks pick (default: auto)")
    p.add_argument("--dir", type=Path, default=Path(".bench-store"), help="scratch directory on the disk under test")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_backends.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # would override file_storage_path
    rows: dict[tuple, Row] = {}
    choice = choose_dtype(args.dtype)
    args.kv_dtype = choice.dtype
    with store_run(args, "backends-", console, model_dtype=choice.dtype, dtype_source=choice.describe()) as ctx:
        ctx.drop_caches()  # learn now whether reads can be cold
        run_all(ctx, rows)
    table = judge(rows, ctx.cold)
    print_table(table, ctx.cold, machine_line(ctx.machine))
    write_result(ctx, console, [{**asdict(r), "value": r.value} for r in table])
    return 0 if all(r.passed is not False for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
