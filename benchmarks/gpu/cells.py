"""One gpu_stream cell: a (geometry, host layout, layer groups, device) measured ``reps`` times, and the
break-even read rate of a geometry.

Each repetition runs every path once, starting from a different one each time (so no path always runs
first, after the page cache drop or on a cold store): before each path the host buffer and the device KV
are zeroed (or, for the device hit, the device KV set to the pages), ``before_read`` runs (drops the page
cache where allowed), and the device is synchronized; none of that is timed. After the first repetition of
each load path the device KV must equal the pages written, byte for byte (``verified``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.gpu import pipeline
from benchmarks.gpu.geometry import Geometry
from benchmarks.gpu.kvstore import DeviceKV, HostKV
from benchmarks.gpu.prefill import StandIn
from sgl_kvtier.keys import PageKey
from sgl_kvtier.sglang.parts_plan import LayerPlan
from sgl_kvtier.sharing.pool import SharedPool

PATHS = ("compute", "load_all", "streamed", "h2d")


def breakeven_rate(geom: Geometry, compute_s: float) -> float:
    """Bytes/s at which the geometry's prefix loads in ``compute_s`` (the suffix's compute time)."""
    if not compute_s > 0:
        raise ValueError(f"compute time must be positive, got {compute_s}")
    return geom.prefix_bytes / compute_s


def run_cell(pool: SharedPool, keys: Sequence[PageKey], host: HostKV, kv: DeviceKV, model: StandIn,
             sync: pipeline.Sync, plan: LayerPlan, expected: torch.Tensor, reps: int,
             before_read: Callable[[], None]) -> dict[str, Any]:
    samples: dict[str, list[float]] = {k: [] for k in ("compute_s", "load_all_s", "read_s", "streamed_s",
                                                      "waited_s", "h2d_s")}
    verified: list[bool] = []
    ok = True
    landed: list[list[float]] = []
    for rep in range(reps):
        order = PATHS[rep % len(PATHS):] + PATHS[:rep % len(PATHS)]
        for path in order:
            host.zero()
            if path == "compute":
                kv.data.copy_(expected)
            else:
                kv.zero()
            if path == "h2d":
                host.fill(expected.view(2, host.geom.layers, host.geom.pages, host.geom.layer_bytes))
            sync.synchronize()
            if path in ("load_all", "streamed"):
                before_read()
            if path == "compute":
                samples["compute_s"].append(pipeline.compute_only(model, kv, sync).total_s)
            elif path == "h2d":
                samples["h2d_s"].append(pipeline.h2d_only(host, kv, sync).total_s)
            elif path == "load_all":
                t = pipeline.load_all(pool, keys, host, kv, model, sync, plan)
                samples["load_all_s"].append(t.total_s)
                samples["read_s"].append(t.read_s or 0.0)
                ok &= t.ok
            else:
                t = pipeline.streamed(pool, keys, host, kv, model, sync, plan)
                samples["streamed_s"].append(t.total_s)
                samples["waited_s"].append(t.waited_s)
                landed.append([round(x, 4) for x in t.group_landed_s])
                ok &= t.ok
            if path in ("load_all", "streamed", "h2d") and rep == 0:
                verified.append(kv.matches(expected))
    median = {k: statistics.median(v) for k, v in samples.items() if v}
    return {"median": median, "samples": samples, "group_landed_s": landed, "ok": ok,
            "verified": bool(verified) and all(verified)}
