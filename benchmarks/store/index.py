"""bench_store's index measures: reopen from a 1M-entry checkpoint, ``longest_prefix`` over 4,096 keys, and
reopen by journal replay, on a store of synthetic 4 KiB pages whose data is never written."""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.store.context import Ctx
from benchmarks.store.rows import Row
from benchmarks.store.stores import namespace, store_config
from sgl_kvtier.config import GiB, StoreConfig
from sgl_kvtier.keys import Namespace
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store import journal_write as jw
from sgl_kvtier.store.page_store import PageStore

LOOKUP_KEYS = 4096
INDEX_PAGE = 4096
CHAIN = 64  # synthetic index: prefix chains of this many pages


@dataclass
class IndexFixture:
    """A store set up for ``n`` synthetic pages, coldest first: page i sits in slot i and chains on page
    i-1 (chains of ``CHAIN``). Only the layout exists on disk; the measures write the index themselves."""

    cfg: StoreConfig
    ns: Namespace
    meta: Path  # the writer's directory: journal and checkpoint
    n: int
    keys: list[bytes]
    sums: list[int]

    @classmethod
    def make(cls, ctx: Ctx) -> IndexFixture:
        n, path = ctx.args.index_pages, ctx.root / "index"
        path.mkdir()
        ns = namespace(INDEX_PAGE, page_tokens=1, model="bench-index")
        cfg = store_config(path, -(-n * INDEX_PAGE // GiB) * GiB, io_depth=ctx.args.io_depth)
        store = open_writer(cfg, ns)  # creates HEADER, its writer directory, a journal and an empty checkpoint
        meta = store.layout.meta
        store.close()
        blob = os.urandom(32 * n)
        return cls(cfg, ns, meta, n, [blob[i * 32:(i + 1) * 32] for i in range(n)],
                   ctx.rng.integers(0, 1 << 63, size=n, dtype=np.uint64).tolist())

    def columns(self, start: int = 0, stop: int | None = None):
        """(keys, slots, checksums, parents) of pages [start, stop); ``parents`` as positions in ``keys`` or -1."""
        stop = min(stop or self.n, self.n)
        pos = np.arange(start, stop, dtype=np.int64)
        parents = np.where(pos % CHAIN != 0, pos - 1, -1)
        return self.keys[start:stop], pos, np.asarray(self.sums[start:stop], dtype=np.uint64), parents

    def timed_open(self, ctx: Ctx) -> tuple[float, float, PageStore]:
        """(wall s, CPU s) to open the store; page cache dropped, none of our garbage left for the GC."""
        gc.collect()
        ctx.drop_caches()
        t0, c0 = time.perf_counter(), time.process_time()
        store = open_writer(self.cfg, self.ns)
        return time.perf_counter() - t0, time.process_time() - c0, store


def measure_reopen_checkpoint(ctx: Ctx, idx: IndexFixture) -> list[Row]:
    times, cpu = [], []
    gen = max(jr.journal_generations(idx.meta), default=0) + 1
    jw.write_checkpoint(idx.meta, *idx.columns(), idx.n, gen)  # also drops the older journals
    task = ctx.task("reopen from checkpoint", ctx.args.reopen_repeats)
    for _ in range(ctx.args.reopen_repeats):
        seconds, cpu_s, store = idx.timed_open(ctx)
        if len(store) != idx.n:
            raise RuntimeError(f"reopen: {len(store)} pages indexed, expected {idx.n}")
        times.append(seconds)
        cpu.append(cpu_s)
        store.close()  # rewrites the same checkpoint (untimed)
        del store
        ctx.step(task)
    return [Row(f"reopen {idx.n / 1e6:g}M pages (checkpoint)", "s", times, max_value=2.0,
                note=f"median of {len(times)} opens; CPU {statistics.median(cpu):.2f} s" + ("" if ctx.cold else ", warm"))]


def measure_lookup(ctx: Ctx, idx: IndexFixture) -> list[Row]:
    store = open_writer(idx.cfg, idx.ns)
    try:
        start = int(ctx.rng.integers(0, len(idx.keys) - LOOKUP_KEYS))
        query, times, cpu = idx.keys[start:start + LOOKUP_KEYS], [], []
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
                note=f"all hit, {idx.n:,} pages indexed, median of {len(times)} calls; CPU {statistics.median(cpu):.3f} ms")]


def measure_reopen_journal(ctx: Ctx, idx: IndexFixture) -> list[Row]:
    for gen in jr.journal_generations(idx.meta):
        jr.journal_path(idx.meta, gen).unlink()
    (idx.meta / jr.CHECKPOINT).unlink(missing_ok=True)
    journal = jw.Journal(idx.meta, 1)
    task = ctx.task("write journal", idx.n)
    for start in range(0, idx.n, 65536):
        keys, slots, sums, parents = idx.columns(start, start + 65536)
        journal.append([jw.put_record(int(s) + 1, k, int(s), int(c), idx.keys[p] if p >= 0 else None)
                        for k, s, c, p in zip(keys, slots, sums, parents)])
        ctx.step(task, len(keys))
    journal.sync()
    journal.close()
    seconds, cpu_s, store = idx.timed_open(ctx)
    replayed = store.recovery.replayed_records
    store.close()
    return [Row(f"reopen {idx.n / 1e6:g}M pages (journal replay)", "s", [seconds],
                note=f"informational: replays {replayed:,} records, folds them into a checkpoint; CPU {cpu_s:.2f} s")]


INDEX_MEASURES: list[Callable[[Ctx, IndexFixture], list[Row]]] = [
    measure_reopen_checkpoint, measure_lookup, measure_reopen_journal]
