"""Benchmark the sgl_kvtier PageStore against fio on the same directory, in the same run.

Regenerate benchmarks/results/bench_store.json (as root, so the page cache can be dropped before cold reads):

    python -m benchmarks.bench_store --page-mib 2 8 --total-gib 2 --rounds 3 \
        --engines threads uring --io-depth 32 --index-pages 1000000 --dir ./.bench-store

Rows and how to read them: docs/benchmarks/store.md. To add a system (e.g. SGLang's ``file`` backend), add a
``(ctx, page_bytes) -> list[Row]`` function to ``throughput_systems`` (``ratio_rows`` builds its put/get rows);
index-level measurements go in ``benchmarks.store.index.INDEX_MEASURES``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from benchmarks.common import RESULTS, make_console, store_room
from benchmarks.machine import machine_line
from benchmarks.store.context import BATCH, Ctx, store_run, write_result
from benchmarks.store.fio import measure_fio
from benchmarks.store.index import INDEX_MEASURES, IndexFixture
from benchmarks.store.rows import Row, merge, ratio_rows
from benchmarks.store.stores import open_store
from sgl_kvtier.config import IOEngineName, MiB

console = make_console()


def measure_kvtier(ctx: Ctx, page_bytes: int, engine: str) -> list[Row]:
    """Put ``--total-gib`` of pages (128 per call, durability ``batch``), drop caches, get them all back."""
    name, nbatch = f"kvtier[{engine}]", ctx.batches(page_bytes)
    nbytes, path = ctx.pass_bytes(page_bytes), ctx.root / f"kvtier-{engine}"
    path.mkdir()
    try:
        store = open_store(path, page_bytes, store_room(nbytes), durability="batch", io_engine=engine,
                           io_depth=ctx.args.io_depth)
    except Exception as exc:  # e.g. io_uring unavailable: report it and go on
        shutil.rmtree(path)
        return ratio_rows(ctx, name, page_bytes, None, None, note=f"unavailable: {exc!r}"[:80])
    try:
        pool = ctx.pool(page_bytes)
        keys = [[os.urandom(32) for _ in range(BATCH)] for _ in range(nbatch)]
        put_s = ctx.timed_batches(f"{name} put {page_bytes // MiB} MiB",
                                  [partial(store.put, k, pool.pages(ctx.rng, BATCH)) for k in keys])
        if store.counters.put_pages != nbatch * BATCH:
            raise RuntimeError(f"{name}: stored {store.counters.put_pages} of {nbatch * BATCH} pages")
        ctx.drop_caches()
        get_s = ctx.timed_batches(f"{name} get {page_bytes // MiB} MiB",
                                  [partial(store.get, k, pool.pages(ctx.rng, BATCH)) for k in keys])
        note = f"engine={store.stats().engine} direct={store.layout.direct}"
    finally:
        store.close()
        shutil.rmtree(path)
    return ratio_rows(ctx, name, page_bytes, nbytes / put_s / 1e9, nbytes / get_s / 1e9, note)


def throughput_systems(args: argparse.Namespace) -> list[Callable[[Ctx, int], list[Row]]]:
    """Every system measured at every page size; add other systems here."""
    return [partial(measure_kvtier, engine=e) for e in args.engines]


def print_table(rows: list[Row], machine: str) -> None:
    table = Table(title="sgl_kvtier PageStore vs fio (same run, same directory; medians over rounds)")
    console.print(f"machine: {machine}", markup=False, highlight=False)
    for col in ("metric", "value", "baseline (fio)", "ratio", "target", "pass/fail", "note"):
        table.add_column(col, justify="left" if col in ("metric", "note") else "right")
    for r in rows:
        value, base = (f"{v:.3f} {r.unit}" if v is not None else "-" for v in (r.value, r.baseline))
        verdict = {True: "[green]PASS", False: "[red]FAIL", None: "-"}[r.passed]
        table.add_row(escape(r.metric), value, base, f"{r.ratio:.2f}x" if r.ratio else "-",
                      r.target or "-", verdict, escape(r.note))
    console.print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-mib", type=int, nargs="+", default=[2, 8], help="page sizes in MiB (default: 2 8)")
    p.add_argument("--total-gib", type=float, default=2.0, help="GiB put and got per page size and round (default: 2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved fio/store rounds; rows show medians (default: 3)")
    p.add_argument("--engines", nargs="+", default=["threads", "uring"], choices=[e.value for e in IOEngineName])
    p.add_argument("--io-depth", type=int, default=32, help="store io_depth and fio --iodepth (default: 32)")
    p.add_argument("--index-pages", type=int, default=1_000_000, help="pages in the reopen/lookup index")
    p.add_argument("--reopen-repeats", type=int, default=3, help="timed reopens from the checkpoint (default: 3)")
    p.add_argument("--lookup-calls", type=int, default=500, help="timed longest_prefix calls (default: 500)")
    p.add_argument("--dir", type=Path, default=Path(".bench-store"), help="scratch directory on the disk under test")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_store.json")
    p.add_argument("--parts", nargs="+", default=["throughput", "index"], choices=["throughput", "index"])
    return p.parse_args(argv)


def run_all(ctx: Ctx) -> list[Row]:
    rows: dict[str, Row] = {}
    for _ in range(ctx.args.rounds if "throughput" in ctx.args.parts else 0):
        for mib in ctx.args.page_mib:
            measure_fio(ctx, mib * MiB)
            for system in throughput_systems(ctx.args):
                merge(rows, system(ctx, mib * MiB))
    if "index" in ctx.args.parts:
        idx = IndexFixture.make(ctx)
        for measure in INDEX_MEASURES:
            merge(rows, measure(ctx, idx))
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The pages are raw bytes; "bf16" is the namespace's nominal dtype (no model runs here).
    with store_run(args, "run-", console, model_dtype="bf16 (nominal: raw page bytes, no model)") as ctx:
        rows = run_all(ctx)
    print_table(rows, machine_line(ctx.machine))
    derived = ("value", "baseline", "ratio", "target", "passed")
    write_result(ctx, console, [{**asdict(r), **{k: getattr(r, k) for k in derived}} for r in rows])
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
