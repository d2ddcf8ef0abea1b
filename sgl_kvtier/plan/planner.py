"""The plan: every candidate L3 size (shared and per instance) replayed beside the baselines, one row each.

Rows: ``no reuse`` (every prompt token computed), ``HBM`` (SGLang's radix cache alone), ``HBM + host``
(HiCache without an L3), then ``L3 <size> shared`` and ``L3 <size> per instance`` for each size. Each row
has the share of prompt tokens each tier served, TTFT p50 / p99, the L3 read rate at the trace's busiest
second, the flash written per day at the trace's rate, and the blocks the L3 dropped for room.
Invariant: for any L3 size, hits on HBM and host memory are those of ``HBM + host`` (the L3 only takes
what they miss).
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sgl_kvtier.plan.replay import (
    Deployment,
    L3Pass,
    LocalPass,
    PoolMode,
    break_even_tokens,
    cacheable_sizes,
    l3_pass,
    local_pass,
    peak_rate,
    percentile,
    timeline,
)
from sgl_kvtier.plan.trace import Trace

DAY_S = 86400.0


@dataclass(frozen=True)
class Row:
    """One configuration's outcome over the trace."""

    name: str
    l3_bytes: float  # 0: no L3
    mode: str  # "shared", "per_instance" or "" (no L3)
    device_share: float  # of all prompt tokens
    host_share: float
    storage_share: float
    ttft_p50_s: float
    ttft_p99_s: float
    peak_read_Bps: float  # L3 bytes read in the busiest second (all instances)
    read_bytes: float
    written_bytes: float
    write_Bpd: float  # flash written per day at the trace's rate
    evicted_blocks: int

    @property
    def hit_share(self) -> float:
        return self.device_share + self.host_share + self.storage_share


@dataclass(frozen=True)
class PlanResult:
    trace: dict[str, Any]
    deployment: dict[str, Any]
    rows: tuple[Row, ...]
    break_even_tokens: int | None
    seconds: float
    storage_over_time: dict[str, list[float]]  # per minute, for the largest shared L3: tokens by tier

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def as_dict(self) -> dict[str, Any]:
        return {"trace": self.trace, "deployment": self.deployment, "rows": [asdict(r) for r in self.rows],
                "break_even_tokens": self.break_even_tokens, "seconds": self.seconds,
                "storage_over_time": self.storage_over_time}


def plan(trace: Trace, dep: Deployment, l3_sizes: Sequence[float],
         modes: Sequence[PoolMode] = (PoolMode.SHARED, PoolMode.PER_INSTANCE),
         progress: Callable[[str], None] | None = None, workers: int = 1) -> PlanResult:
    """Replay ``trace`` for every L3 size in ``l3_sizes`` (bytes, all instances together) and ``modes``; with
    ``workers`` > 1 the HBM-only pass and the L3 passes run in that many forked processes."""
    if not trace.requests:
        raise ValueError("the trace has no requests")
    started = time.perf_counter()
    step = progress or (lambda _: None)
    sizes = cacheable_sizes(trace, dep.page_tokens)
    inputs = np.array([r.input_tokens for r in trace.requests], np.int64)
    arrival = np.array([r.arrival_s for r in trace.requests])
    total = float(inputs.sum())
    span = max(trace.duration_s, 1.0)
    zeros = np.zeros(len(inputs), np.int64)

    def row(name: str, local: LocalPass | None, storage: np.ndarray, written: np.ndarray, l3: float, mode: str,
            evicted: int) -> Row:
        dev = local.device_tokens if local is not None else zeros
        host = local.host_tokens if local is not None else zeros
        inst = local.instance if local is not None else np.arange(len(inputs)) % dep.instances
        tl = timeline(trace, dep, inst, dev + host + storage, storage, host)
        read = storage * dep.bytes_per_token
        return Row(name, l3, mode, float(dev.sum()) / total, float(host.sum()) / total, float(storage.sum()) / total,
                   percentile(tl.ttft_s, 50), percentile(tl.ttft_s, 99), peak_rate(arrival, read.astype(float)),
                   float(read.sum()), float(written.sum() * dep.bytes_per_token),
                   float(written.sum() * dep.bytes_per_token) / span * DAY_S, evicted)

    local = local_pass(trace, dep, sizes, host=True)
    step("HBM + host")
    jobs: list[tuple[float, PoolMode] | None] = [None] + [(size, mode) for size in sorted(l3_sizes) for mode in modes]
    results = _run_jobs(jobs, (trace, dep, sizes, local), workers, step)
    hbm = results[0]
    assert isinstance(hbm, LocalPass)
    rows = [row("no reuse", None, zeros, zeros, 0.0, "", 0), row("HBM", hbm, zeros, zeros, 0.0, "", 0),
            row("HBM + host", local, zeros, zeros, 0.0, "", 0)]
    over_time: dict[str, list[float]] = {}
    for job, l3 in zip(jobs[1:], results[1:]):
        assert job is not None and isinstance(l3, L3Pass)
        size, mode = job
        rows.append(row(_label(size, mode), local, l3.storage_tokens, l3.written_tokens, size, mode.value,
                        l3.evicted))
        if mode is PoolMode.SHARED and size == max(l3_sizes):
            over_time = per_minute(arrival, {"device": local.device_tokens, "host": local.host_tokens,
                                             "storage": l3.storage_tokens, "input": inputs})
    return PlanResult(trace.summary(), deployment_record(dep), tuple(rows), break_even_tokens(dep),
                      time.perf_counter() - started, over_time)


_STATE: tuple[Trace, Deployment, list[list[int]], LocalPass] | None = None  # what a forked worker replays


def _label(size: float, mode: PoolMode) -> str:
    return f"L3 {human_bytes(size)} {'shared' if mode is PoolMode.SHARED else 'per instance'}"


def _job(job: tuple[float, PoolMode] | None) -> LocalPass | L3Pass:
    """One pass over ``_STATE``: HBM alone (None) or an L3 of (size, mode) over HBM + host memory."""
    assert _STATE is not None
    trace, dep, sizes, local = _STATE
    if job is None:
        return local_pass(trace, dep, sizes, host=False)
    return l3_pass(trace, dep, sizes, local, job[0], job[1])


def _run_jobs(jobs: list[tuple[float, PoolMode] | None], state: tuple[Trace, Deployment, list[list[int]], LocalPass],
              workers: int, step: Callable[[str], None]) -> list[LocalPass | L3Pass]:
    """Every job's pass, in order: in this process, or in forked ones (they inherit ``state``, nothing is
    pickled but the results)."""
    global _STATE
    _STATE = state
    try:
        if workers <= 1 or len(jobs) == 1 or "fork" not in multiprocessing.get_all_start_methods():
            out = []
            for job in jobs:
                out.append(_job(job))
                step("HBM" if job is None else _label(*job))
            return out
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {pool.submit(_job, job): i for i, job in enumerate(jobs)}
            done: dict[int, LocalPass | L3Pass] = {}
            for fut in as_completed(futures):
                job = jobs[futures[fut]]
                step("HBM" if job is None else _label(*job))
                done[futures[fut]] = fut.result()
            return [done[i] for i in range(len(jobs))]
    finally:
        _STATE = None


def per_minute(arrival: np.ndarray, series: dict[str, np.ndarray]) -> dict[str, list[float]]:
    """Each series summed per minute of arrival."""
    minute = (arrival // 60).astype(np.int64)
    n = int(minute.max()) + 1 if len(minute) else 0
    return {k: np.bincount(minute, weights=v.astype(float), minlength=n).tolist() for k, v in series.items()}


def deployment_record(dep: Deployment) -> dict[str, Any]:
    return {"instances": dep.instances, "hbm_tokens": dep.hbm_tokens, "host_tokens": dep.host_tokens,
            "page_tokens": dep.page_tokens, "bytes_per_token": dep.bytes_per_token,
            "read_Bps": dep.array.bandwidth_Bps, "batch_latency_s": dep.array.batch_latency_s,
            "h2d_Bps": dep.h2d_Bps, "routing": dep.routing.value, "eviction": dep.eviction.value,
            "prefill": asdict(dep.prefill)}


def human_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.3g} {unit}"
    return f"{n:.0f} B"
