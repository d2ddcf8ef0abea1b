"""The frame of a real-server benchmark run (``bench_serving``, ``bench_policy``, ``bench_peers``): its output
directory and device, the machine facts, one measured phase on a running server, every workload level played on
one server, and the files it leaves.

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

from benchmarks.common import RESULTS, drop_caches, make_console, timestamp, write_json
from benchmarks.machine import machine_info
from benchmarks.serving.models import ServedModel, served_dtype
from benchmarks.serving.probes import cpu_seconds
from benchmarks.serving.workloads import Request, Workload
from sgl_kvtier.serving import client, summary


def add_device_args(p: argparse.ArgumentParser) -> None:
    """``--gpu`` / ``--cpu`` into ``args.gpu`` (None: auto-detected by ``start``)."""
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--gpu", dest="gpu", action="store_true", default=None, help="GPU flags (default: auto-detect)")
    dev.add_argument("--cpu", dest="gpu", action="store_false", help="CPU route even if a GPU is present")


def add_multiturn_args(p: argparse.ArgumentParser, *, clients: int, rounds: int, system_tokens: int,
                       user_tokens: int, answer_tokens: int) -> argparse._ArgumentGroup:
    """The multi-turn workload's flags (``workloads.multiturn``), with a script's defaults; their group."""
    g = p.add_argument_group("multiturn")
    g.add_argument("--clients", type=int, default=clients)
    g.add_argument("--rounds", type=int, default=rounds)
    g.add_argument("--system-tokens", type=int, default=system_tokens)
    g.add_argument("--user-tokens", type=int, default=user_tokens)
    g.add_argument("--answer-tokens", type=int, default=answer_tokens)
    return g


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


Probe = Callable[[], dict[str, float]]


def serve_levels(args: argparse.Namespace, srv: Any, wls: dict[tuple[str, int, int], Workload], page_size: int, *,
                 label: str, l3: bool, flush: bool, drop: bool, kvbpt: int, bars: Any, task: Any, console: Console,
                 rep: int = 0, into: dict[str, list[dict[str, Any]]] | None = None,
                 probe: Probe | None = None) -> dict[str, list[dict[str, Any]]]:
    """Play every workload level (``wls``: (workload, level index, concurrency) -> workload) on the running server
    ``srv``, phase by phase; returns (and fills ``into``, level by level, so a failure keeps what was measured)
    workload -> levels, each ``{"concurrency", "salt", "phases", "summary"}``.

    Before each phase: with ``l3``, L3 write-back waited for (``args.backup_wait``; with
    ``args.flush_between_phases`` until every page of the phases before is backed up); with
    ``args.flush_between_phases`` and ``flush``, L1 + L2 flushed (``POST /flush_cache``); with ``drop``, the OS
    page cache dropped. ``probe`` (optional) is read before and after each phase; both readings are kept.
    """
    out: dict[str, list[dict[str, Any]]] = {} if into is None else into
    for (wl_name, li, conc), wl in wls.items():
        phases: list[dict[str, Any]] = []
        unique = wl.unique_tokens(page_size)
        base = 0.0
        for pi, phase in enumerate(wl.phases):
            settle: dict[str, Any] = {}
            if l3:
                # Smoke mode needs every page of the earlier phases in L3 before the flush; a real run
                # only waits for write-back to go quiet (pages dropped under pressure never arrive).
                want = base + unique[pi - 1] if args.flush_between_phases and pi > 0 else 0
                settle["backups"] = client.wait_backups(srv.url, want, args.backup_wait)
                base = settle["backups"]["backuped_tokens"] if pi == 0 else base
            if args.flush_between_phases and pi > 0 and flush:
                settle["flush_s"] = srv.flush_cache(timeout_s=120)
            if drop:
                settle["drop_caches_s"] = drop_caches()
            bars.update(task, description=f"{label} {wl_name} C={conc} phase {pi}{'' if pi else ' (warm-up)'}")
            before = probe() if probe is not None else None
            m = measure_phase(srv, phase, conc, lambda _r: bars.advance(task))
            extra = {"probe_before": before, "probe_after": probe()} if probe is not None else {}
            phases.append({"phase": pi, "measured": pi > 0, "settle": settle, **m, **extra})
        for p in phases:
            p["repeat"] = rep
        level = {"concurrency": conc, "salt": li, "phases": phases, "summary": summary.summarize(phases, kvbpt)}
        out.setdefault(wl_name, []).append(level)
        s = level["summary"]
        console.log(f"{label:13s} {wl_name} C={conc}: TTFT p50 {s['ttft_p50_s']:.2f} s p99 {s['ttft_p99_s']:.2f} s, "
                    f"cached dev/host/storage {s['cached_tokens']['device']}/{s['cached_tokens']['host']}/"
                    f"{s['cached_tokens']['storage']} of {s['prompt_tokens']}, {s['errors']} errors")
    return out


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
