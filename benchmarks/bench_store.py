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
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from benchmarks.common import RESULTS, make_console
from benchmarks.machine import machine_line
from benchmarks.store.context import BATCH, Ctx, store_run, write_result
from benchmarks.store.fio import measure_fio
from benchmarks.store.hostpool import HostPool
from benchmarks.store.index import INDEX_MEASURES, IndexFixture
from benchmarks.store.rows import Row, latency_row, merge, ratio_rows
from benchmarks.store.stores import namespace, open_store
from benchmarks.store.writers import measure_writers
from sgl_kvtier.config import IOEngineName, MiB
from sgl_kvtier.store.format import BLOCK_HEADER_BYTES
from sgl_kvtier.store.layout import slot_bytes_of
from sgl_kvtier.store.page_store import PageStore

console = make_console()
LATENCY_PAGES = 64  # the batch whose get latency is judged against fio's


def measure_kvtier(ctx: Ctx, page_bytes: int, engine: str) -> list[Row]:
    """Steady-state puts (durability ``batch``) then cold gets of ``--total-gib`` of pages, 128 per call.

    The store holds exactly one pass of pages. An untimed pass fills it (its segment files are laid out
    then, as fio lays out its file before its timed job); the timed pass puts new pages, each evicting the
    coldest and reusing its slot, as a running server does. The gets read the timed pass back."""
    name, nbatch = f"kvtier[{engine}]", ctx.batches(page_bytes)
    nbytes, path = ctx.pass_bytes(page_bytes), ctx.root / f"kvtier-{engine}"
    label = f"{name} {page_bytes / MiB:g} MiB"
    path.mkdir()
    try:
        store = open_store(path, page_bytes, nbatch * BATCH * slot_bytes_of(namespace(page_bytes)),
                           durability="batch", io_engine=engine, io_depth=ctx.args.io_depth, **raw_keys(ctx, path))
    except Exception as exc:  # e.g. io_uring unavailable: report it and go on
        shutil.rmtree(path)
        return ratio_rows(ctx, name, page_bytes, None, None, note=f"unavailable: {exc!r}"[:80])
    try:
        pool = ctx.pool(page_bytes)
        fill, keys = ([[os.urandom(32) for _ in range(BATCH)] for _ in range(nbatch)] for _ in range(2))
        ctx.timed_batches(f"{label} fill (untimed)", [partial(store.put, k, pool.pages(ctx.rng, BATCH)) for k in fill])
        with ctx.profiled(store, f"{label} put", nbatch):
            put_s = ctx.timed_batches(f"{label} put", [partial(store.put, k, pool.pages(ctx.rng, BATCH))
                                                       for k in keys])
        counters = store.counters
        if counters.put_pages != 2 * nbatch * BATCH or counters.evictions != nbatch * BATCH:
            raise RuntimeError(f"{name}: stored {counters.put_pages} pages with {counters.evictions} evictions, "
                               f"want {2 * nbatch * BATCH} with {nbatch * BATCH}")
        ctx.drop_caches()
        with ctx.profiled(store, f"{label} get", nbatch):
            get_s = ctx.timed_batches(f"{label} get", [partial(store.get, k, pool.pages(ctx.rng, BATCH))
                                                       for k in keys])
        note = f"engine={store.stats().engine} direct={store.layout.direct}" + (
            f" raw={ctx.args.raw_device}" if ctx.args.raw_device else "")
        lat_ms = batch_latency_ms(ctx, store, pool, [k for batch in keys for k in batch], LATENCY_PAGES)
    finally:
        store.close()
        shutil.rmtree(path)
    return [*ratio_rows(ctx, name, page_bytes, nbytes / put_s / 1e9, nbytes / get_s / 1e9, note),
            latency_row(ctx, name, page_bytes, LATENCY_PAGES, lat_ms, note)]


def batch_latency_ms(ctx: Ctx, store: PageStore, pool: HostPool, keys: list[bytes], pages: int) -> float:
    """Median ms of one ``pages``-page get (every page verified), over up to 16 distinct spans of ``keys``."""
    spans = [keys[i:i + pages] for i in range(0, len(keys) - pages + 1, pages)][:16]
    times = []
    for span in spans:
        dst = pool.pages(ctx.rng, pages)
        t0 = time.perf_counter()
        ok = store.get(span, dst)
        times.append((time.perf_counter() - t0) * 1e3)
        if not all(ok):
            raise RuntimeError(f"latency: {ok.count(False)} of {pages} pages failed")
    return statistics.median(times)


def raw_keys(ctx: Ctx, meta: Path) -> dict[str, Any]:
    """With ``--raw-device``: the store's config keys for it (journal and checkpoint in ``meta``), after zeroing
    its first MiB (the region table: each store starts on a blank device). Otherwise none."""
    raw = ctx.args.raw_device
    if raw is None:
        return {}
    fd = os.open(raw, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(BLOCK_HEADER_BYTES), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"devices": [str(raw)], "meta_dir": str(meta)}


def throughput_systems(args: argparse.Namespace) -> list[Callable[[Ctx, int], list[Row]]]:
    """Every system measured at every page size; add other systems here."""
    return [partial(measure_kvtier, engine=e) for e in args.engines] + [
        partial(measure_writers, engine=e, n=n) for e in args.engines for n in args.writers if n > 1]


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


def print_profile(title: str, phases: list[dict]) -> None:
    """One profiled pass: where its time went (``benchmarks.store.profile``)."""
    table = Table(title=f"profile: {title} (last round; io thread rows are summed over the IO threads)")
    for col in ("phase", "s", "calls", "ms/batch", "us/page", "of wall"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for p in phases:
        share = "-" if p["share"] is None else f"{p['share']:.0%}"
        table.add_row(escape(p["phase"]), f"{p['seconds']:.3f}", str(p["calls"]), f"{p['ms_per_batch']:.2f}",
                      f"{p['us_per_page']:.1f}", share)
    console.print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-mib", type=float, nargs="+", default=[2, 8],
                   help="page sizes in MiB, 0.125 for 128 KiB (default: 2 8)")
    p.add_argument("--total-gib", type=float, default=2.0, help="GiB put and got per page size and round (default: 2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved fio/store rounds; rows show medians (default: 3)")
    p.add_argument("--engines", nargs="+", default=["threads", "uring"], choices=[e.value for e in IOEngineName])
    p.add_argument("--io-depth", type=int, default=32, help="store io_depth and fio --iodepth (default: 32)")
    p.add_argument("--index-pages", type=int, default=1_000_000, help="pages in the reopen/lookup index")
    p.add_argument("--reopen-repeats", type=int, default=3, help="timed reopens from the checkpoint (default: 3)")
    p.add_argument("--lookup-calls", type=int, default=500, help="timed longest_prefix calls (default: 500)")
    p.add_argument("--dir", type=Path, default=Path(".bench-store"), help="scratch directory on the disk under test")
    p.add_argument("--raw-device", type=Path, default=None,
                   help="measure the raw-device path on this block device (ITS CONTENTS ARE DESTROYED): fio and "
                        "the store use it directly; --dir then holds only the journal and checkpoint")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_store.json")
    p.add_argument("--writers", type=int, nargs="+", default=[1],
                   help="also measure this many writer processes on one pool, e.g. 2 4 (1: the rows above)")
    p.add_argument("--profile", action="store_true",
                   help="print where put and get time goes, phase by phase (benchmarks/store/profile.py)")
    p.add_argument("--parts", nargs="+", default=["throughput", "index"], choices=["throughput", "index"])
    return p.parse_args(argv)


def run_all(ctx: Ctx) -> list[Row]:
    rows: dict[str, Row] = {}
    for _ in range(ctx.args.rounds if "throughput" in ctx.args.parts else 0):
        for mib in ctx.args.page_mib:
            page_bytes = round(mib * MiB)
            measure_fio(ctx, page_bytes)
            for system in throughput_systems(ctx.args):
                merge(rows, system(ctx, page_bytes))
    if "index" in ctx.args.parts:
        idx = IndexFixture.make(ctx)
        for measure in INDEX_MEASURES:
            merge(rows, measure(ctx, idx))
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.raw_device is not None and max(args.writers) > 1:
        raise SystemExit("--writers measures a directory pool; leave --raw-device out")
    # The pages are raw bytes; "bf16" is the namespace's nominal dtype (no model runs here).
    with store_run(args, "run-", console, model_dtype="bf16 (nominal: raw page bytes, no model)") as ctx:
        rows = run_all(ctx)
    print_table(rows, machine_line(ctx.machine))
    for title, phases in ctx.profiles.items():
        print_profile(title, phases)
    derived = ("value", "baseline", "ratio", "target", "passed")
    write_result(ctx, console, [{**asdict(r), **{k: getattr(r, k) for k in derived}} for r in rows],
                 **({"profiles": ctx.profiles} if ctx.profiles else {}))
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
