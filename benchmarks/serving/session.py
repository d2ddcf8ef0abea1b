"""The frame of a real-server benchmark run (``bench_serving``, ``bench_policy``): its output directory and
device, the machine facts, one measured phase on a running server, and the files it leaves.

A run's ``results.json`` is rewritten after every server, so a crash keeps what was measured;
``finish`` writes the last one, ``report.md`` and the plots.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.common import RESULTS, make_console, timestamp, write_json
from benchmarks.machine import machine_info
from benchmarks.serving import client
from benchmarks.serving.models import ServedModel, served_dtype
from benchmarks.serving.probes import cpu_seconds
from benchmarks.serving.workloads import Request


def start(args: argparse.Namespace, prefix: str) -> tuple[Console, str]:
    """(console, start time); ``args.out`` defaults to ``benchmarks/results/<prefix>-<time>/`` and is made,
    ``args.gpu`` None becomes whether a CUDA GPU is present."""
    started = timestamp()
    args.out = (args.out or RESULTS / f"{prefix}-{started}").resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.gpu is None:
        from sgl_kvtier.serving.hardware import has_cuda_gpu

        args.gpu = has_cuda_gpu()
    return make_console(stderr=True), started


def machine(model: ServedModel, server_args: Sequence[str]) -> dict[str, Any]:
    """The machine facts of a serving run (the servers run on this machine too), with the dtype its servers
    run the model in and how that was chosen (``server_args``: every server's flags, the model's included)."""
    dtype, source = served_dtype(model, server_args)
    return machine_info(dtype, dtype_source=source) | {"loadavg_start": os.getloadavg()}


def measure_phase(srv: Any, requests: list[Request], concurrency: int,
                  on_done: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Send ``requests`` (at most ``concurrency`` in flight) and record the phase: wall seconds, the server's
    and the machine's CPU seconds and the load average, ``/metrics`` before and the delta, every request."""
    before = client.counters(client.scrape(srv.url))
    cpu0, load0 = cpu_seconds(srv.proc.pid), os.getloadavg()[0]
    recs, wall = client.run_phase(srv.url, requests, concurrency, on_done)
    cpu1 = cpu_seconds(srv.proc.pid)
    after = client.counters(client.scrape(srv.url))
    cpu = {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0} | {"loadavg_1m": [load0, os.getloadavg()[0]]}
    return {"wall_s": wall, "cpu": cpu, "metrics_before": before, "metrics_delta": client.delta(after, before),
            "requests": recs}


def failure(console: Console, label: str, exc: Exception) -> str:
    """Say that one server (``label``) failed, and return the error as the results record it; the run goes on."""
    console.print(f"[red]{label} failed: {type(exc).__name__}: {exc}"[:3000])
    return repr(exc)[:3000]


def save(run: dict[str, Any], out: Path) -> Path:
    return write_json(out / "results.json", run)


def finish(run: dict[str, Any], out: Path, markdown: Callable[[dict[str, Any]], str],
           plot: Callable[[dict[str, Any], Path], Any], console: Console) -> None:
    """Write the final results.json, report.md and the plots; print the report."""
    run["machine"]["loadavg_end"] = os.getloadavg()
    save(run, out)
    md = markdown(run)
    (out / "report.md").write_text(md)
    plot(run, out)
    console.print(md, markup=False, highlight=False)
    console.print(f"results: {out}")
