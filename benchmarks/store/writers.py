"""Several writer processes on one pool: ``bench_store --writers 2 4``.

Each of ``n`` processes (spawned) opens its own writer of the same namespace in the same directory (sharing
``host``, the default: own segments and journal each), fills its store once untimed, then all start their
timed steady-state puts together (a barrier), then, after the parent dropped the page cache, their gets.
The figure is the pool's: ``n`` passes of bytes over the wall time from the first start to the last end
(``time.monotonic``, one clock for every process). Its baseline is fio with ``--numjobs n`` (a file per
job, the same block size, queue depth and bytes per job) in the same directory, its bandwidth summed over
the jobs (``--group_reporting``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.store.context import BATCH, Ctx
from benchmarks.store.fio import run_fio
from benchmarks.store.hostpool import HostPool
from benchmarks.store.rows import Row
from benchmarks.store.stores import namespace, open_store
from sgl_kvtier.config import MiB
from sgl_kvtier.store.layout import slot_bytes_of

_TIMEOUT_S = 600.0  # a worker that has not reached a barrier by then has failed


def _writer(root: str, page_bytes: int, nbatch: int, engine: str, depth: int, seed: int, barrier: Any,
            out: Any) -> None:
    """One writer process: untimed fill, barrier, timed puts, barrier, barrier (the parent drops caches),
    timed gets; puts (start, end, error or None) on ``out``."""
    times: dict[str, Any] = {"error": None}
    try:
        rng = np.random.default_rng(seed)
        pool = HostPool(page_bytes, 2 * BATCH, rng)
        store = open_store(Path(root), page_bytes, nbatch * BATCH * slot_bytes_of(namespace(page_bytes)),
                           durability="batch", io_engine=engine, io_depth=depth)
        try:
            fill, keys = ([[os.urandom(32) for _ in range(BATCH)] for _ in range(nbatch)] for _ in range(2))
            for k in fill:
                store.put(k, pool.pages(rng, BATCH))
            for op, call in (("put", store.put), ("get", store.get)):
                barrier.wait(_TIMEOUT_S)
                if op == "get":
                    barrier.wait(_TIMEOUT_S)  # the parent dropped the page cache in between
                start = time.monotonic()
                ok = sum(sum(call(k, pool.pages(rng, BATCH))) for k in keys)
                times[op] = (start, time.monotonic())
                if ok != nbatch * BATCH:
                    raise RuntimeError(f"{op}: {ok} of {nbatch * BATCH} pages")
        finally:
            store.close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        times["error"] = repr(exc)
        barrier.abort()
    out.put(times)


def measure_writers(ctx: Ctx, page_bytes: int, engine: str, n: int) -> list[Row]:
    """Pool put/get GB/s of ``n`` writer processes at one page size, against fio with ``n`` jobs."""
    nbatch = ctx.batches(page_bytes)
    nbytes = ctx.pass_bytes(page_bytes)
    fio_w, _ = run_fio(ctx, page_bytes, "write", nbytes, jobs=n)
    ctx.drop_caches()
    fio_r, _ = run_fio(ctx, page_bytes, "read", nbytes, jobs=n)
    path = ctx.root / f"writers-{engine}"
    path.mkdir()
    spawn = mp.get_context("spawn")
    barrier, out = spawn.Barrier(n + 1), spawn.Queue()
    procs = [spawn.Process(target=_writer, args=(str(path), page_bytes, nbatch, engine, ctx.args.io_depth, 100 + i,
                                                 barrier, out)) for i in range(n)]
    try:
        for p in procs:
            p.start()
        try:
            barrier.wait(_TIMEOUT_S)  # all filled: the timed puts start
            barrier.wait(_TIMEOUT_S)  # all put
            ctx.drop_caches()
            barrier.wait(_TIMEOUT_S)  # the timed gets start
        except Exception:  # noqa: BLE001 - a worker aborted the barrier: its error is on the queue
            pass
        results = [out.get(timeout=_TIMEOUT_S) for _ in procs]
    finally:
        for p in procs:
            p.join(_TIMEOUT_S)
        shutil.rmtree(path)
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        raise RuntimeError(f"{n} writers: {errors[0]}")
    rows = []
    for op, fio, need in (("put", fio_w, 0.85), ("get", fio_r, 0.9)):
        span = max(r[op][1] for r in results) - min(r[op][0] for r in results)
        name = op if op == "put" else ("get cold" if ctx.cold else "get WARM")
        rows.append(Row(f"kvtier[{engine}] {name} {page_bytes / MiB:g} MiB x{n} writers", "GB/s",
                        [n * nbytes / span / 1e9], [fio], need,
                        note=f"{n} processes, one pool; fio --numjobs={n}"))
    return rows
