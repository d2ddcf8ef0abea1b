"""The context of a store-level run (``bench_store``, ``bench_backends``): arguments, scratch root, progress
bars, the random generator, whether reads are cold, this round's fio figures, and the host pools."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

from benchmarks.common import args_json, drop_caches, progress, scratch_dir, write_json
from benchmarks.machine import machine_info
from benchmarks.store.fio import fio_version
from benchmarks.store.hostpool import HostPool
from benchmarks.store.profile import PhaseProfile
from sgl_kvtier.config import GiB

BATCH = 128  # pages per put/get call, like SGLang's HiCache backup/prefetch batches (STORAGE_BATCH_SIZE)


@dataclass
class Ctx:
    args: argparse.Namespace
    root: Path
    progress: Progress
    rng: np.random.Generator
    cold: bool = True  # False once the page cache could not be dropped: reads are then marked warm
    fio: dict[int, dict] = field(default_factory=dict)  # page_bytes -> this round's {"write", "read" (GB/s), ...}
    fio_log: list[dict] = field(default_factory=list)  # every fio run, all rounds
    pools: dict[int, HostPool] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    profiles: dict[str, list[dict]] = field(default_factory=dict)  # "--profile": pass -> phases (last round)

    def pool(self, page_bytes: int) -> HostPool:
        """A random host pool of 2x a batch of slots (so each batch lands scattered), made once per page size."""
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

    def fio_target(self) -> Path:
        """What fio reads and writes: ``--raw-device`` if given, else a file in the scratch directory."""
        raw = getattr(self.args, "raw_device", None)
        return Path(raw) if raw else self.root / "fio.dat"

    def batches(self, page_bytes: int) -> int:
        """128-page batches that make up ``--total-gib`` at this page size (at least one)."""
        return max(1, round(self.args.total_gib * GiB / (BATCH * page_bytes)))

    def pass_bytes(self, page_bytes: int) -> int:
        """Bytes of one pass over ``batches(page_bytes)`` batches."""
        return self.batches(page_bytes) * BATCH * page_bytes

    def drop_caches(self) -> None:
        """Drop the page cache (root only); otherwise warn once and mark this run's reads as warm."""
        try:
            drop_caches()
        except OSError as exc:
            if self.cold:
                self.progress.console.print(f"[yellow]cannot drop the page cache ({exc.strerror}); reads are "
                                            "marked 'warm'")
            self.cold = False

    @contextlib.contextmanager
    def profiled(self, store: Any, title: str, batches: int) -> Iterator[None]:
        """With ``--profile``: the block's phases of ``store`` (one timed pass of ``batches`` batches) go to
        ``profiles[title]``; without it, nothing."""
        if not getattr(self.args, "profile", False):
            yield
            return
        prof = PhaseProfile()
        t0 = time.perf_counter()
        with prof.active(store):
            yield
        self.profiles[title] = prof.rows(batches, batches * BATCH, time.perf_counter() - t0)

    def timed_batches(self, label: str, calls: list[Callable[[], list[bool]]]) -> float:
        """Run the calls under a progress bar; total seconds spent inside them. Every page must succeed."""
        task, spent = self.task(label, len(calls)), 0.0
        for call in calls:
            t0 = time.perf_counter()
            ok = call()
            spent += time.perf_counter() - t0
            if not all(ok):
                raise RuntimeError(f"{label}: {ok.count(False)} of {len(ok)} pages failed")
            self.step(task)
        return spent


@contextlib.contextmanager
def store_run(args: argparse.Namespace, prefix: str, console: Console, model_dtype: str,
              dtype_source: str | None = None) -> Iterator[Ctx]:
    """A run's context: a scratch directory under ``args.dir`` (removed afterwards), a progress display, and
    the machine facts. ``model_dtype``: the dtype of the pages measured, ``dtype_source`` how it was chosen."""
    with scratch_dir(args.dir, prefix) as root:
        machine = {**machine_info(model_dtype, path=root, dtype_source=dtype_source), "fio": fio_version()}
        with progress(console, spinner=True, transient=True) as bars:
            yield Ctx(args, root, bars, np.random.default_rng(0), machine=machine)


def write_result(ctx: Ctx, console: Console, rows: list[dict[str, Any]], **extra: Any) -> None:
    """``args.out``: the machine, whether reads were cold, the arguments, fio's raw runs and the rows."""
    result = {"machine": {**ctx.machine, "loadavg_1m_end": os.getloadavg()[0]}, "cold_reads": ctx.cold,
              "batch_pages": BATCH, **extra, "args": args_json(ctx.args), "fio_runs": ctx.fio_log, "rows": rows}
    console.print(f"wrote {write_json(ctx.args.out, result)}")
