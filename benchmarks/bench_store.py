"""Benchmark the sgl_kvtier PageStore against fio on the same directory, in the same run.

Regenerate benchmarks/results/bench_store.json (as root, so the page cache can be dropped before cold reads):

    cd /work/main && .venv/bin/python benchmarks/bench_store.py --page-mib 2 8 --total-gib 2 --rounds 3 \
        --engines threads uring --io-depth 32 --index-pages 1000000 --dir ./.bench-store

Rows and how to read them: benchmarks/README.md. To add a system (e.g. SGLang's ``file`` backend), add a
``(ctx, page_bytes) -> list[Row]`` function to ``throughput_systems`` (``ratio_rows`` builds its put/get rows);
index-level measurements go in ``INDEX_MEASURES``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.markup import escape
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from sgl_kvtier.config import Durability, GiB, IOEngineName, MiB, StoreConfig  # noqa: E402
from sgl_kvtier.io.buffers import AlignedBuffer  # noqa: E402
from sgl_kvtier.keys import Namespace  # noqa: E402
from sgl_kvtier.store import journal as jr  # noqa: E402
from sgl_kvtier.store.page_store import PageStore  # noqa: E402

BATCH = 128  # pages per put/get call, like SGLang's HiCache backup/prefetch batches
LOOKUP_KEYS = 4096
INDEX_PAGE = 4096
CHAIN = 64  # synthetic index: prefix chains of this many pages
console = Console(width=None if sys.stdout.isatty() else 180, log_path=False)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


@dataclass
class Row:
    """One table row; ``samples``/``baselines`` hold one value per round and the row shows their medians."""

    metric: str
    unit: str
    samples: list[float | None]
    baselines: list[float] = field(default_factory=list)  # fio, same unit
    min_ratio: float | None = None  # target: value >= min_ratio x baseline
    max_value: float | None = None  # target: value <= max_value
    note: str = ""

    value = property(lambda self: _median(self.samples))
    baseline = property(lambda self: _median(self.baselines))
    ratio = property(lambda self: self.value / self.baseline if self.value is not None and self.baseline else None)

    @property
    def target(self) -> str:
        if self.min_ratio is not None:
            return f">= {self.min_ratio:g}x fio"
        return "" if self.max_value is None else f"<= {self.max_value:g} {self.unit}"

    @property
    def passed(self) -> bool | None:
        if self.min_ratio is not None and self.ratio is not None:
            return self.ratio >= self.min_ratio
        return None if self.max_value is None or self.value is None else self.value <= self.max_value


def ratio_rows(ctx: Ctx, name: str, page_bytes: int, put: float | None, get: float | None, note: str = "") -> list[Row]:
    """Put/get rows (GB/s) of one system at one page size, judged against this round's fio write/read."""
    fio, get_op = ctx.fio[page_bytes], "get cold" if ctx.cold else "get WARM"
    return [Row(f"{name} {op} {page_bytes // MiB} MiB", "GB/s", [value], [fio[rw]], need, note=note)
            for op, value, rw, need in (("put", put, "write", 0.85), (get_op, get, "read", 0.9))]


def merge(rows: dict[str, Row], new: list[Row]) -> None:
    """Fold one round's rows into the table, keyed by metric."""
    for row in new:
        old = rows.setdefault(row.metric, row)
        if old is not row:
            old.samples, old.baselines, old.note = old.samples + row.samples, old.baselines + row.baselines, row.note


class HostPool:
    """A prefaulted page_first-style host pool: all K halves, then all V halves; a page is 2 runs."""

    def __init__(self, page_bytes: int, slots: int, rng: np.random.Generator):
        self.half, self.slots = page_bytes // 2, slots
        self.buf = AlignedBuffer(page_bytes * slots)
        words = np.frombuffer(self.buf.view, dtype=np.uint64)
        for start in range(0, words.size, 8 * MiB):  # random bytes, filled in chunks (no big temporaries)
            chunk = words[start:start + 8 * MiB]
            chunk[:] = rng.integers(0, 1 << 63, size=chunk.size, dtype=np.uint64)

    def pages(self, rng: np.random.Generator, n: int) -> list[list[tuple[int, int]]]:
        """``n`` distinct pool slots at random (scattered) positions, each as [(K addr, len), (V addr, len)]."""
        base, v_base = self.buf.address, self.buf.address + self.slots * self.half
        return [[(base + int(s) * self.half, self.half), (v_base + int(s) * self.half, self.half)]
                for s in rng.permutation(self.slots)[:n]]


@dataclass
class Ctx:
    args: argparse.Namespace
    root: Path
    progress: Progress
    rng: np.random.Generator
    cold: bool = True
    fio: dict[int, dict] = field(default_factory=dict)  # page_bytes -> this round's {"write", "read" (GB/s), ...}
    fio_log: list[dict] = field(default_factory=list)  # every fio run, all rounds
    pools: dict[int, HostPool] = field(default_factory=dict)
    index: dict = field(default_factory=dict)

    def pool(self, page_bytes: int) -> HostPool:  # 2x a batch of slots, so each batch lands scattered
        if page_bytes not in self.pools:
            self.pools[page_bytes] = HostPool(page_bytes, 2 * BATCH, self.rng)
        return self.pools[page_bytes]

    def task(self, label: str, total: int) -> int:
        return self.progress.add_task(escape(label), total=total, start_s=time.perf_counter())

    def step(self, task: int, n: int = 1) -> None:
        """Advance a bar; a finished bar becomes a log line (many live bars cost GIL time to redraw)."""
        self.progress.advance(task, n)
        t = next(t for t in self.progress.tasks if t.id == task)
        if t.finished:
            self.progress.remove_task(task)
            self.progress.console.log(f"{t.description}: {time.perf_counter() - t.fields['start_s']:.1f} s")

    def batches(self, page_bytes: int) -> int:
        return max(1, round(self.args.total_gib * GiB / (BATCH * page_bytes)))

    def drop_caches(self) -> None:
        """Drop the page cache (root only); otherwise mark this run's reads as warm."""
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError as exc:
            if self.cold:
                console.print(f"[yellow]cannot drop the page cache ({exc.strerror}); reads are marked 'warm'")
            self.cold = False


def run_fio(ctx: Ctx, page_bytes: int, rw: str, nbytes: int) -> tuple[float, str]:
    """fio bandwidth (GB/s) with the store's block size and queue depth; io_uring, else libaio, else psync."""
    path, errors = ctx.root / "fio.dat", []
    for engine in ("io_uring", "libaio", "psync"):
        cmd = ["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={page_bytes}",
               f"--iodepth={ctx.args.io_depth}", f"--ioengine={engine}", "--direct=1", f"--size={nbytes}",
               "--output-format=json"] + (["--end_fsync=1"] if rw == "write" else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        try:
            job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
            if proc.returncode == 0 and job["error"] == 0 and job[rw]["bw_bytes"] > 0:
                return job[rw]["bw_bytes"] / 1e9, engine
        except (ValueError, KeyError, IndexError):
            pass
        errors.append(f"{engine}: rc={proc.returncode} {proc.stderr.strip()[-200:]}")
    raise RuntimeError("fio failed with every engine: " + "; ".join(errors))


def measure_fio(ctx: Ctx, page_bytes: int) -> None:
    nbytes = ctx.batches(page_bytes) * BATCH * page_bytes
    task = ctx.task(f"fio {page_bytes // MiB} MiB write+read", 2)
    (ctx.root / "fio.dat").unlink(missing_ok=True)
    write, engine = run_fio(ctx, page_bytes, "write", nbytes)
    ctx.step(task)
    ctx.drop_caches()
    read, _ = run_fio(ctx, page_bytes, "read", nbytes)
    ctx.step(task)
    (ctx.root / "fio.dat").unlink(missing_ok=True)
    ctx.fio[page_bytes] = {"write": write, "read": read, "engine": engine, "bytes": nbytes}
    ctx.fio_log.append({"page_mib": page_bytes // MiB, **ctx.fio[page_bytes]})


def store_config(ctx: Ctx, path: Path, capacity: int, engine: str = "auto") -> StoreConfig:
    return StoreConfig(devices=(str(path),), capacity_bytes=capacity, durability=Durability.BATCH,
                       io_engine=IOEngineName(engine), io_depth=ctx.args.io_depth)


def timed_batches(ctx: Ctx, label: str, calls: list[Callable[[], list[bool]]]) -> float:
    """Run the calls under a progress bar; total seconds spent inside them. Every page must succeed."""
    task, spent = ctx.task(label, len(calls)), 0.0
    for call in calls:
        t0 = time.perf_counter()
        ok = call()
        spent += time.perf_counter() - t0
        if not all(ok):
            raise RuntimeError(f"{label}: {ok.count(False)} of {len(ok)} pages failed")
        ctx.step(task)
    return spent


def measure_kvtier(ctx: Ctx, page_bytes: int, engine: str) -> list[Row]:
    name, nbatch = f"kvtier[{engine}]", ctx.batches(page_bytes)
    nbytes, path = nbatch * BATCH * page_bytes, ctx.root / f"kvtier-{engine}"
    path.mkdir()
    ns = Namespace("bench", "bf16", "page_first", 64, page_bytes)
    try:
        store = PageStore.open(store_config(ctx, path, nbytes + GiB, engine), ns)
    except Exception as exc:  # e.g. io_uring unavailable: report it and go on
        shutil.rmtree(path)
        return ratio_rows(ctx, name, page_bytes, None, None, note=f"unavailable: {exc!r}"[:80])
    try:
        pool = ctx.pool(page_bytes)
        keys = [[os.urandom(32) for _ in range(BATCH)] for _ in range(nbatch)]
        put_s = timed_batches(ctx, f"{name} put {page_bytes // MiB} MiB",
                              [partial(store.put, k, pool.pages(ctx.rng, BATCH)) for k in keys])
        if store.counters.put_pages != nbatch * BATCH:
            raise RuntimeError(f"{name}: stored {store.counters.put_pages} of {nbatch * BATCH} pages")
        ctx.drop_caches()
        get_s = timed_batches(ctx, f"{name} get {page_bytes // MiB} MiB",
                              [partial(store.get, k, pool.pages(ctx.rng, BATCH)) for k in keys])
        note = f"engine={store.stats().engine} direct={store.layout.direct}"
    finally:
        store.close()
        shutil.rmtree(path)
    return ratio_rows(ctx, name, page_bytes, nbytes / put_s / 1e9, nbytes / get_s / 1e9, note)


def throughput_systems(args: argparse.Namespace) -> list[Callable[[Ctx, int], list[Row]]]:
    """Every system measured at every page size; add other systems here."""
    return [partial(measure_kvtier, engine=e) for e in args.engines]


def index_store(ctx: Ctx) -> dict:
    """A store set up for ``--index-pages`` synthetic 4 KiB pages (their data is never written)."""
    if not ctx.index:
        n, path = ctx.args.index_pages, ctx.root / "index"
        path.mkdir()
        ns = Namespace("bench-index", "bf16", "page_first", 1, INDEX_PAGE)
        cfg = store_config(ctx, path, -(-n * INDEX_PAGE // GiB) * GiB)
        PageStore.open(cfg, ns).close()  # creates HEADER, LOCK, a journal and an empty checkpoint
        blob = os.urandom(32 * n)
        ctx.index = {"cfg": cfg, "ns": ns, "meta": path / ns.dirname(), "n": n,
                     "keys": [blob[i * 32:(i + 1) * 32] for i in range(n)],
                     "sums": ctx.rng.integers(0, 1 << 63, size=n, dtype=np.uint64).tolist()}
    return ctx.index


def index_columns(idx: dict, start: int = 0, stop: int | None = None):
    """Synthetic index, coldest first: page i sits in slot i and chains on page i-1 (chains of CHAIN).

    Returns (keys, slots, checksums, parents) with ``parents`` as positions in the full key list (or -1).
    """
    stop = min(stop or idx["n"], idx["n"])
    pos = np.arange(start, stop, dtype=np.int64)
    parents = np.where(pos % CHAIN != 0, pos - 1, -1)
    return idx["keys"][start:stop], pos, np.asarray(idx["sums"][start:stop], dtype=np.uint64), parents


def timed_open(ctx: Ctx) -> tuple[float, float, PageStore]:
    """(wall s, CPU s) to open the index store; page cache dropped, none of our garbage left for the GC."""
    gc.collect()
    ctx.drop_caches()
    t0, c0 = time.perf_counter(), time.process_time()
    store = PageStore.open(ctx.index["cfg"], ctx.index["ns"])
    return time.perf_counter() - t0, time.process_time() - c0, store


def measure_reopen_checkpoint(ctx: Ctx) -> list[Row]:
    idx, times, cpu = index_store(ctx), [], []
    gen = max(jr.journal_generations(idx["meta"]), default=0) + 1
    jr.write_checkpoint(idx["meta"], *index_columns(idx), idx["n"], gen)  # also drops the older journals
    task = ctx.task("reopen from checkpoint", ctx.args.reopen_repeats)
    for _ in range(ctx.args.reopen_repeats):
        seconds, cpu_s, store = timed_open(ctx)
        if len(store) != idx["n"]:
            raise RuntimeError(f"reopen: {len(store)} pages indexed, expected {idx['n']}")
        times.append(seconds)
        cpu.append(cpu_s)
        store.close()  # rewrites the same checkpoint (untimed)
        del store
        ctx.step(task)
    return [Row(f"reopen {idx['n'] / 1e6:g}M pages (checkpoint)", "s", times, max_value=2.0,
                note=f"median of {len(times)} opens; CPU {statistics.median(cpu):.2f} s" + ("" if ctx.cold else ", warm"))]


def measure_lookup(ctx: Ctx) -> list[Row]:
    idx = index_store(ctx)
    store = PageStore.open(idx["cfg"], idx["ns"])
    try:
        start = int(ctx.rng.integers(0, len(idx["keys"]) - LOOKUP_KEYS))
        query, times, cpu = idx["keys"][start:start + LOOKUP_KEYS], [], []
        task = ctx.task(f"longest_prefix x{ctx.args.lookup_calls}", ctx.args.lookup_calls)
        for _ in range(ctx.args.lookup_calls):
            t0, c0 = time.perf_counter(), time.process_time()
            hit = store.longest_prefix(query)
            times.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
            ctx.step(task)
        if hit != LOOKUP_KEYS:
            raise RuntimeError(f"longest_prefix returned {hit}, expected {LOOKUP_KEYS}")
    finally:
        store.close()
    return [Row(f"longest_prefix {LOOKUP_KEYS:,} keys", "ms", times, max_value=1.0,
                note=f"all hit, {idx['n']:,} pages indexed, median of {len(times)} calls; CPU {statistics.median(cpu):.3f} ms")]


def measure_reopen_journal(ctx: Ctx) -> list[Row]:
    idx = index_store(ctx)
    for gen in jr.journal_generations(idx["meta"]):
        jr.journal_path(idx["meta"], gen).unlink()
    (idx["meta"] / jr.CHECKPOINT).unlink(missing_ok=True)
    journal = jr.Journal(idx["meta"], 1)
    task = ctx.task("write journal", idx["n"])
    for start in range(0, idx["n"], 65536):
        keys, slots, sums, parents = index_columns(idx, start, start + 65536)
        journal.append([jr.put_record(int(s) + 1, k, int(s), int(c), idx["keys"][p] if p >= 0 else None)
                        for k, s, c, p in zip(keys, slots, sums, parents)])
        ctx.step(task, len(keys))
    journal.sync()
    journal.close()
    seconds, cpu_s, store = timed_open(ctx)
    replayed = store.recovery.replayed_records
    store.close()
    return [Row(f"reopen {idx['n'] / 1e6:g}M pages (journal replay)", "s", [seconds],
                note=f"informational: replays {replayed:,} records, folds them into a checkpoint; CPU {cpu_s:.2f} s")]


INDEX_MEASURES: list[Callable[[Ctx], list[Row]]] = [measure_reopen_checkpoint, measure_lookup, measure_reopen_journal]


def machine_info(path: Path) -> dict:
    def sh(*cmd: str) -> str:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    source, fstype = (sh("df", "--output=source,fstype", str(path)).splitlines()[-1:] or ["? ?"])[0].split()
    return {"nproc": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "fs_source": source, "fs_type": fstype, "root": os.geteuid() == 0, "fio": sh("fio", "--version"),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
            "loadavg_1m": os.getloadavg()[0]}


def print_table(rows: list[Row]) -> None:
    table = Table(title="sgl_kvtier PageStore vs fio (same run, same directory; medians over rounds)")
    for col in ("metric", "value", "baseline (fio)", "ratio", "target", "pass/fail", "note"):
        table.add_column(col, justify="left" if col in ("metric", "note") else "right")
    for r in rows:
        fmt = (lambda v: f"{v:.3f} {r.unit}" if v is not None else "-")
        verdict = {True: "[green]PASS", False: "[red]FAIL", None: "-"}[r.passed]
        table.add_row(escape(r.metric), fmt(r.value), fmt(r.baseline), f"{r.ratio:.2f}x" if r.ratio else "-",
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
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "bench_store.json")
    p.add_argument("--parts", nargs="+", default=["throughput", "index"], choices=["throughput", "index"])
    return p.parse_args(argv)


def run_all(ctx: Ctx) -> list[Row]:
    rows: dict[str, Row] = {}
    for _ in range(ctx.args.rounds if "throughput" in ctx.args.parts else 0):
        for mib in ctx.args.page_mib:
            measure_fio(ctx, mib * MiB)
            for system in throughput_systems(ctx.args):
                merge(rows, system(ctx, mib * MiB))
    for measure in INDEX_MEASURES if "index" in ctx.args.parts else []:
        merge(rows, measure(ctx))
    return list(rows.values())


@contextlib.contextmanager
def scratch_run(args: argparse.Namespace, prefix: str):
    """A scratch directory under ``args.dir`` for one run, a progress display, and the machine facts;
    everything made here is removed afterwards (``args.dir`` too if this run created it)."""
    made_dir = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=args.dir))
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        machine = machine_info(root)
        with Progress(*columns, console=console, transient=True, refresh_per_second=4) as progress:
            yield root, progress, machine
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if made_dir:
            shutil.rmtree(args.dir, ignore_errors=True)


def write_result(args: argparse.Namespace, ctx: "Ctx", machine: dict, rows: list[dict], **extra) -> None:
    """``args.out``: the machine, the run's arguments, fio's raw runs and the rows, as JSON."""
    result = {"machine": {**machine, "loadavg_1m_end": os.getloadavg()[0]}, "cold_reads": ctx.cold,
              "batch_pages": BATCH, **extra, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "fio_runs": ctx.fio_log, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with scratch_run(args, "run-") as (root, progress, machine):
        ctx = Ctx(args, root, progress, np.random.default_rng(0))
        rows = run_all(ctx)
    print_table(rows)
    derived = ("value", "baseline", "ratio", "target", "passed")
    write_result(args, ctx, machine, [{**asdict(r), **{k: getattr(r, k) for k in derived}} for r in rows])
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
