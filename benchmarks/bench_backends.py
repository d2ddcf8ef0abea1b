"""Store-level comparison: sgl-kvtier vs SGLang's ``file`` backend vs fio, same pages, same directory, same run.

Both backends are made by SGLang's ``StorageBackendFactory`` ("file" with ``file_storage_path``; "dynamic" with
``interface_v1`` for ``KVTierStorage``), get SGLang's real ``MHATokenToKVPoolHost`` (CPU, pin_memory=False, bf16,
64-token pages) through ``register_mem_pool_host``, and are driven by the controller's own page functions
(``HiCacheController._generic_page_set/_generic_page_get`` for ``file``, ``_page_set_zero_copy/_page_get_zero_copy``
for ours, chosen by the controller's rule) in 128-page batches from/to scattered host slots. Every page read
back is compared with the page written; a mismatch fails the run.

Regenerate benchmarks/results/bench_backends.json (as root, so the page cache can be dropped before cold reads):

    cd /work/main && .venv/bin/python benchmarks/bench_backends.py --page-mib 2 8 --total-gib 2 --rounds 3 \
        --io-depth 32 --layout page_first_direct --dir ./.bench-store

Rows and how to read them: benchmarks/README.md (section bench_backends.py).
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

import numpy as np
import torch
from rich.markup import escape
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_store import (  # also puts the repo on sys.path
    BATCH,
    Ctx,
    _median,
    console,
    measure_fio,
    scratch_run,
    write_result,
)
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from sgl_kvtier.config import GiB, MiB

PAGE_TOKENS, HEADS, HEAD_DIM = 64, 8, 128  # bf16: one layer of one page (K+V) = 64*8*256*2 B = 256 KiB
LAYER_BYTES = PAGE_TOKENS * HEADS * 2 * HEAD_DIM * 2
SYSTEMS = ("file", "kvtier")
ORDER = ("file", "kvtier", "fio")  # table rows
TARGET = 5.0  # kvtier >= 5x file, reads and writes


@dataclass
class Row:
    metric: str
    system: str  # file / kvtier / fio
    op: str  # put / get / exists cold / exists warm
    page_mib: float
    unit: str  # GB/s (higher is better) or ms (lower is better)
    samples: list[float] = field(default_factory=list)
    note: str = ""
    vs_file: float | None = None  # speedup over file (for ms rows: file ms / this ms)
    vs_fio: float | None = None
    target: str = ""
    passed: bool | None = None

    value = property(lambda self: _median(self.samples))


class BenchOp:
    """What the controller's page functions read from ``self`` (a prefetch op that is never terminated)."""

    request_id = "bench"

    @staticmethod
    def is_terminated() -> bool:
        return False


class ControllerPath:
    """SGLang's own HiCacheController page get/set functions, bound to a stand-in carrying the attributes they use.

    The family is picked exactly as ``attach_storage_backend`` does: zero-copy v1 for ``dynamic`` with a truthy
    ``interface_v1``, else the legacy copy path (``get_data_page`` flat copies / dummy pages +
    ``set_from_flat_data_page``)."""

    def __init__(self, backend_type: str, backend, pool, extra: dict):
        self.storage_backend, self.storage_host_pool, self.mem_pool_host = backend, pool, pool
        self.page_size = pool.page_size
        c = HiCacheController
        self.zero_copy = backend_type == "dynamic" and bool(extra.get("interface_v1", 0))
        self.set = partial(c._page_set_zero_copy if self.zero_copy else c._generic_page_set, self)
        self.get = partial(c._page_get_zero_copy if self.zero_copy else c._generic_page_get, self, BenchOp())


def host_pool(page_mib: float, layout: str, pages: int) -> MHATokenToKVPoolHost:
    """SGLang's real MHA host pool of ``pages`` pages (64 tokens, 8 KV heads, head_dim 128, bf16), random bytes."""
    layers = int(page_mib * MiB) // LAYER_BYTES
    if layers * LAYER_BYTES != int(page_mib * MiB):
        raise SystemExit(f"--page-mib {page_mib}: must be a multiple of {LAYER_BYTES / MiB} MiB (one layer)")
    device = MHATokenToKVPool(2 * PAGE_TOKENS, PAGE_TOKENS, torch.bfloat16, HEADS, HEAD_DIM, layers, "cpu", False,
                              start_layer=0, end_layer=layers - 1)
    pool = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE_TOKENS, layout,
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                                end_layer=layers - 1, host_token_capacity=pages * PAGE_TOKENS)
    pool.bench_device_pool = device  # keep the device buffers the pool's buffer info points at alive
    words = pool.kv_buffer.view(torch.uint8).reshape(-1).numpy().view(np.uint64)
    rng = np.random.default_rng(1)
    for start in range(0, words.size, 8 * MiB):
        chunk = words[start:start + 8 * MiB]
        chunk[:] = rng.integers(0, 1 << 63, size=chunk.size, dtype=np.uint64)
    return pool


def slot_indices(pages) -> torch.Tensor:
    """Token-slot host_indices for the given page numbers (what the host allocator hands the controller)."""
    return torch.cat([torch.arange(int(p) * PAGE_TOKENS, (int(p) + 1) * PAGE_TOKENS, dtype=torch.int64) for p in pages])


def page_equal(pool, a: int, b: int) -> bool:
    """Bitwise page equality (int16 view: random bf16 bits contain NaNs)."""
    return torch.equal(pool.get_data_page(a * PAGE_TOKENS, flat=False).view(torch.int16),
                       pool.get_data_page(b * PAGE_TOKENS, flat=False).view(torch.int16))


def make_backend(kind: str, path: Path, pool, nbytes: int, io_depth: int, layout: str):
    """(backend, ControllerPath) made the way the controller's attach does: factory, then register the pool."""
    if kind == "file":
        backend_type, extra = "file", {"file_storage_path": str(path)}
    else:
        backend_type, extra = "dynamic", {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang",
                                          "class_name": "KVTierStorage", "interface_v1": 1, "devices": [str(path)],
                                          "capacity_bytes": nbytes + GiB, "io_depth": io_depth,
                                          # Read-ahead would move the reads into the timed-apart batch_exists
                                          # call; these rows measure the device path itself.
                                          "readahead_bytes": 0}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=layout != "layer_first", model_name="bench/model",
                               extra_config=extra)
    backend = StorageBackendFactory.create_backend(backend_type, cfg, pool)
    backend.register_mem_pool_host(pool)
    if kind == "file" and Path(backend.file_path) != path:
        raise RuntimeError(f"file backend writes to {backend.file_path}, not {path}")
    return backend, ControllerPath(backend_type, backend, pool, extra)


def close(backend) -> None:
    if hasattr(backend, "close"):  # the controller's detach does the same
        backend.close()


def measure_backend(ctx: Ctx, kind: str, page_mib: float, pool) -> dict:
    """Write N pages (128 per call), reopen after dropping caches, batch_exists cold/warm, read back and verify."""
    page_bytes = int(page_mib * MiB)
    nbatch = ctx.batches(page_bytes)
    n, nbytes, path = nbatch * BATCH, nbatch * BATCH * page_bytes, ctx.root / kind
    path.mkdir()
    keys = [os.urandom(32).hex() for _ in range(n)]
    src = [ctx.rng.permutation(2 * BATCH)[:BATCH] for _ in range(nbatch)]  # scattered source pages per batch
    args, label = ctx.args, f"{kind} {page_mib:g} MiB"
    backend, io = make_backend(kind, path, pool, nbytes, args.io_depth, args.layout)
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
        put_note = path_note + (", fdatasync per call" if kind == "kvtier" else
                                f", no fsync (with a trailing sync: {nbytes / (put_s + sync_s) / 1e9:.2f} GB/s)")
        close(backend)
        ctx.drop_caches()
        backend, io = make_backend(kind, path, pool, nbytes, args.io_depth, args.layout)  # as after a restart
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
            for p in dst:
                pool.get_data_page(int(p) * PAGE_TOKENS, flat=False).zero_()
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
        shutil.rmtree(path, ignore_errors=True)
    return {"put": nbytes / put_s / 1e9, "get": nbytes / get_s / 1e9, "exists cold": cold_ms,
            "exists warm": statistics.median(warm_ms), "exists_keys": len(query),
            "put_note": put_note, "get_note": path_note + ", verified byte-exact"}


def run_all(ctx: Ctx, rows: dict[tuple, Row]) -> None:
    pools = {}
    for rnd in range(ctx.args.rounds):
        for mib in ctx.args.page_mib:
            if mib not in pools:
                pools[mib] = host_pool(mib, ctx.args.layout, 3 * BATCH)  # 2 batches of sources, 1 of landing slots
            page_bytes = int(mib * MiB)
            measure_fio(ctx, page_bytes)
            for op, rw in (("put", "write"), ("get", "read")):
                add(rows, "fio", op, mib, "GB/s", ctx.fio[page_bytes][rw], f"engine={ctx.fio[page_bytes]['engine']}, "
                    f"bs={mib:g} MiB, iodepth={ctx.args.io_depth}, O_DIRECT" + (", end_fsync" if rw == "write" else ""))
            for kind in (SYSTEMS if rnd % 2 == 0 else SYSTEMS[::-1]):  # alternate who goes first
                res = measure_backend(ctx, kind, mib, pools[mib])
                for op in ("put", "get"):
                    add(rows, kind, op, mib, "GB/s", res[op], res[f"{op}_note"])
                for op in ("exists cold", "exists warm"):
                    add(rows, kind, op, mib, "ms", res[op], f"{res['exists_keys']:,} keys, all present"
                        + (f"; median of {ctx.args.exists_repeats}" if op == "exists warm" else "; first call after reopen"))


def add(rows: dict, system: str, op: str, mib: float, unit: str, value: float, note: str) -> None:
    row = rows.setdefault((mib, op, system), Row(f"{system} {op} {mib:g} MiB", system, op, mib, unit))
    row.samples.append(value)
    row.note = note


def judge(rows: dict[tuple, Row], cold: bool) -> list[Row]:
    for (mib, op, system), row in rows.items():
        if op == "get" and system != "fio":
            row.metric = f"{system} get {'cold' if cold else 'WARM'} {mib:g} MiB"
        base, fio = rows.get((mib, op, "file")), rows.get((mib, op, "fio"))
        if base and base.value and row.value:
            row.vs_file = row.value / base.value if row.unit == "GB/s" else base.value / row.value
        if fio and fio.value and row.value and row.unit == "GB/s":
            row.vs_fio = row.value / fio.value
        if system == "kvtier" and op in ("put", "get"):
            row.target, row.passed = f">= {TARGET:g}x file", (row.vs_file or 0) >= TARGET
    order = {"put": 0, "get": 1, "exists cold": 2, "exists warm": 3}
    return sorted(rows.values(), key=lambda r: (order[r.op] > 1, r.page_mib, order[r.op], ORDER.index(r.system)))


def print_table(rows: list[Row], cold: bool) -> None:
    table = Table(title="sgl-kvtier vs SGLang `file` vs fio (same pages, same directory, same run; medians over "
                        f"rounds){'' if cold else ' -- READS WARM: not root'}")
    for col in ("metric", "value", "vs file", "vs fio", "target", "pass/fail", "note"):
        table.add_column(col, justify="left" if col in ("metric", "note") else "right")
    for r in rows:
        verdict = {True: "[green]PASS", False: "[red]FAIL", None: "-"}[r.passed]
        table.add_row(escape(r.metric), f"{r.value:.3f} {r.unit}" if r.value is not None else "-",
                      f"{r.vs_file:.2f}x" if r.vs_file else "-", f"{r.vs_fio:.2f}x" if r.vs_fio else "-",
                      r.target or "-", verdict, escape(r.note))
    console.print(table)
    console.print("vs file = speedup over SGLang's file backend (for ms rows: file ms / this ms); "
                  "vs fio = GB/s / fio GB/s at the same bs and iodepth.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-mib", type=float, nargs="+", default=[2, 8], help="page sizes, multiples of 0.25 (default: 2 8)")
    p.add_argument("--total-gib", type=float, default=2.0, help="GiB written and read per backend, page size and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (fio, file, kvtier); rows show medians (default: 3)")
    p.add_argument("--io-depth", type=int, default=32, help="kvtier io_depth and fio --iodepth (default: 32)")
    p.add_argument("--layout", default="page_first_direct", choices=["page_first_direct", "page_first", "layer_first"])
    p.add_argument("--exists-keys", type=int, default=1000, help="keys per batch_exists call (at most the pages written)")
    p.add_argument("--exists-repeats", type=int, default=20, help="warm batch_exists calls (default: 20)")
    p.add_argument("--dir", type=Path, default=Path(".bench-store"), help="scratch directory on the disk under test")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "bench_backends.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # would override file_storage_path
    rows: dict[tuple, Row] = {}
    with scratch_run(args, "backends-") as (root, progress, machine):
        ctx = Ctx(args, root, progress, np.random.default_rng(0))
        ctx.drop_caches()  # learn now whether reads can be cold
        run_all(ctx, rows)
    table = judge(rows, ctx.cold)
    print_table(table, ctx.cold)
    write_result(args, ctx, machine, [{**asdict(r), "value": r.value} for r in table],
                 torch_threads=torch.get_num_threads())
    return 0 if all(r.passed is not False for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
