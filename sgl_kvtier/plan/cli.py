"""``sgl-kvtier plan``: the arguments, their checks, and the run (table, advice, ``plan.json`` / ``plan.md`` /
``plan.png`` under ``--out``).

Prefill time, one of: ``--prefill A,B[,F]`` (the cost model's coefficients: seconds per new token, seconds
per new token per 1000 tokens of context, fixed seconds), ``--prefill-metrics URL|FILE`` (the same fitted by
a running sgl-kvtier server, read from its Prometheus ``/metrics``), or ``--gpu-tflops T [--mfu M]`` (a
roofline from the model's active parameters). Array figures: ``--read-gbps`` and ``--latency-ms``, or
``--measured bench_store.json`` (the store's own get and 64-page latency rows nearest the plan's page size).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from sgl_kvtier.config import EvictionPolicyName
from sgl_kvtier.errors import ConfigError
from sgl_kvtier.estimation import DeviceModel
from sgl_kvtier.plan import report
from sgl_kvtier.plan.model import KV_DTYPE_BYTES, Geometry
from sgl_kvtier.plan.planner import plan
from sgl_kvtier.plan.replay import Deployment, PoolMode, Routing
from sgl_kvtier.plan.trace import TraceFormat, load
from sgl_kvtier.policy.cost_model import PrefillModel

SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtTpP]?)i?[bB]?\s*$")
SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


def parse_bytes(text: str, field: str = "l3_sizes") -> float:
    """``500G``, ``4T``, ``1.5TB``, ``2e12`` (decimal units)."""
    m = SIZE.match(text)
    try:
        value = float(m.group(1)) * SCALE[m.group(2).lower()] if m else float(text)
    except ValueError:
        raise ConfigError(field, f"not a size: {text!r} (e.g. 500G, 4T)") from None
    if not value > 0:
        raise ConfigError(field, f"must be > 0, got {text!r}")
    return value


def add_plan_parser(sub: Any) -> None:
    """Add the ``plan`` sub-command to the CLI's sub-parsers."""
    p = sub.add_parser("plan", help="predict hit rate, TTFT and flash traffic per L3 size from a request trace",
                       description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("trace")
    g.add_argument("--trace", required=True, help="a Mooncake-format JSONL trace, or SGLang request log(s)")
    g.add_argument("--format", choices=[f.value for f in TraceFormat], help="default: guessed from the first record")
    g.add_argument("--trace-block-tokens", type=int, help="tokens per trace block (Mooncake: 512; SGLang logs: "
                   "the page size)")
    g.add_argument("--duration", type=float, help="replay only the first S seconds")
    g.add_argument("--repeat", type=int, default=1, help="replay the trace N times back to back (own blocks each)")
    g = p.add_argument_group("model")
    g.add_argument("--model", help="a config.json, or a model directory holding one")
    for name in ("layers", "q-heads", "kv-heads", "head-dim"):
        g.add_argument(f"--{name}", type=int, help="without --model (or to override it)")
    g.add_argument("--mla-dim", type=int, default=None, help="kv_lora_rank + qk_rope_head_dim of an MLA model")
    g.add_argument("--kv-dtype", choices=sorted(KV_DTYPE_BYTES), help="default: the config's dtype")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--active-params", type=float, help="parameters one token passes through (default: from the "
                   "config)")
    g = p.add_argument_group("deployment (per instance)")
    g.add_argument("--instances", type=int, default=1)
    g.add_argument("--hbm-kv-gb", type=float, required=True, help="the KV pool in HBM, all ranks")
    g.add_argument("--host-kv-gb", type=float, default=0.0, help="HiCache's host pool, all ranks")
    g.add_argument("--page-tokens", type=int, default=64)
    g.add_argument("--routing", choices=[r.value for r in Routing], default=Routing.CACHE_AWARE.value)
    g.add_argument("--h2d-gbps", type=float, default=25.0, help="host memory to HBM")
    g.add_argument("--prefetch-threshold", type=int, default=256,
                   help="SGLang's prefetch_threshold: L3 spans and hits of fewer tokens are recomputed")
    g = p.add_argument_group("the array (per instance)")
    g.add_argument("--read-gbps", type=float, help="read bandwidth one instance gets")
    g.add_argument("--write-gbps", type=float, help="write bandwidth one instance gets (flags rows that need more)")
    g.add_argument("--latency-ms", type=float, default=1.0, help="fixed cost of one 128-page storage batch")
    g.add_argument("--measured", help="bench_store's JSON: read and write GB/s and batch latency from its rows")
    g.add_argument("--eviction", choices=[e.value for e in EvictionPolicyName], default="chain")
    g = p.add_argument_group("prefill (one of)")
    g.add_argument("--prefill", help="A,B[,F]: seconds per token, per token per 1k context, fixed")
    g.add_argument("--prefill-metrics", help="a sgl-kvtier server's /metrics URL or a saved copy")
    g.add_argument("--gpu-tflops", type=float, help="dense TFLOP/s per GPU (roofline)")
    g.add_argument("--mfu", type=float, default=0.4, help="utilisation of --gpu-tflops in prefill")
    g = p.add_argument_group("candidates and output")
    g.add_argument("--l3-sizes", nargs="+", required=True, help="L3 sizes, all instances together (500G 4T ...)")
    g.add_argument("--modes", nargs="+", choices=[m.value for m in PoolMode], default=[m.value for m in PoolMode])
    g.add_argument("--out", type=Path, help="write plan.json, plan.md and plan.png here")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    g.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes for the passes")
    p.set_defaults(func=cmd_plan)


def geometry(args: argparse.Namespace) -> Geometry:
    if args.model:
        g = Geometry.from_config(args.model, kv_dtype=args.kv_dtype, tp=args.tp, pp=args.pp,
                                 active_params=args.active_params)
        over = {k: v for k, v in (("layers", args.layers), ("q_heads", args.q_heads), ("kv_heads", args.kv_heads),
                                  ("head_dim", args.head_dim), ("mla_dim", args.mla_dim)) if v is not None}
        return dataclasses.replace(g, **over) if over else g
    missing = [n for n in ("layers", "q_heads", "kv_heads", "head_dim") if getattr(args, n) is None]
    if missing:
        raise ConfigError("model", f"give --model, or --{' --'.join(m.replace('_', '-') for m in missing)}")
    return Geometry("model", args.layers, args.q_heads, args.kv_heads, args.head_dim, args.kv_dtype or "bfloat16",
                    args.tp, args.pp, args.mla_dim or 0, args.active_params or 0.0)


def prefill_model(args: argparse.Namespace, g: Geometry) -> tuple[PrefillModel, str]:
    given = [n for n in ("prefill", "prefill_metrics", "gpu_tflops") if getattr(args, n) is not None]
    if len(given) != 1:
        raise ConfigError("prefill", "give exactly one of --prefill, --prefill-metrics, --gpu-tflops")
    if args.prefill is not None:
        try:
            parts = [float(x) for x in args.prefill.split(",")]
            if not 2 <= len(parts) <= 3 or min(parts) < 0 or not parts[0] + parts[1] > 0:
                raise ValueError
        except ValueError:
            raise ConfigError("prefill", f"expected A,B[,F] (non-negative seconds), got {args.prefill!r}") from None
        return PrefillModel(*parts), f"given: {args.prefill}"
    if args.prefill_metrics is not None:
        return metrics_prefill(args.prefill_metrics), f"fitted by the server ({args.prefill_metrics})"
    return g.roofline(args.gpu_tflops, args.mfu), f"roofline: {args.gpu_tflops} TFLOP/s x {args.tp} GPUs at {args.mfu:.0%}"


def metrics_prefill(source: str) -> PrefillModel:
    """The prefill model a running server fitted, from its Prometheus text (the first rank's series)."""
    try:
        if source.startswith(("http://", "https://")):
            with urllib.request.urlopen(source, timeout=10) as resp:  # noqa: S310 - an operator's own endpoint
                text = resp.read().decode()
        else:
            text = Path(source).read_text()
    except OSError as exc:
        raise ConfigError("prefill_metrics", f"cannot read {source}: {exc}") from None
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^kvtier_prefill_(per_token_seconds|per_token_kctx_seconds|fixed_seconds|samples)"
                     r"(?:\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1) not in found:
            found[m.group(1)] = float(m.group(2))
    if not found.get("samples") or not found.get("per_token_seconds"):
        raise ConfigError("prefill_metrics", f"{source} has no fitted prefill model (kvtier_prefill_* with samples)")
    return PrefillModel(found["per_token_seconds"], found.get("per_token_kctx_seconds", 0.0),
                        found.get("fixed_seconds", 0.0))


def array_figures(args: argparse.Namespace, page_bytes: int) -> tuple[float, float | None, float, str]:
    """(read B/s, write B/s or None, batch latency s, where they came from)."""
    if args.measured:
        return measured(args.measured, page_bytes)
    if args.read_gbps is None or not args.read_gbps > 0:
        raise ConfigError("read_gbps", "give the array's read GB/s per instance (or --measured)")
    if args.latency_ms < 0:
        raise ConfigError("latency_ms", f"must be >= 0, got {args.latency_ms}")
    write = args.write_gbps * 1e9 if args.write_gbps else None
    return args.read_gbps * 1e9, write, args.latency_ms / 1e3, "given"


def measured(path: str, page_bytes: int) -> tuple[float, float | None, float, str]:
    """From bench_store's JSON: its get and put GB/s and its 64-page get latency at the page size nearest
    ``page_bytes`` (the latency is spread as a fixed cost per batch less what the bandwidth accounts for)."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError("measured", f"not a bench_store result: {path}: {exc}") from None
    by: dict[str, dict[float, float]] = {"get": {}, "put": {}, "latency": {}}
    for row in rows:
        m = re.match(r"^kvtier\[\w+\] (put|get cold|get 64 pages latency) ([0-9.]+) MiB$", str(row.get("metric")))
        if m and row.get("value") is not None:
            kind = {"put": "put", "get cold": "get", "get 64 pages latency": "latency"}[m.group(1)]
            by[kind][float(m.group(2)) * 2**20] = float(row["value"])
    if not by["get"]:
        raise ConfigError("measured", f"{path} has no 'get cold' rows")
    size = min(by["get"], key=lambda s: abs(s - page_bytes))
    read = by["get"][size] * 1e9
    write = by["put"].get(size)
    lat_ms = by["latency"].get(size)
    latency = max(0.0, lat_ms / 1e3 - 64 * size / read) if lat_ms is not None else 0.0
    return read, write * 1e9 if write else None, latency, f"measured ({path}, {size / 2**20:g} MiB pages)"


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    g = geometry(args)
    prefill, prefill_from = prefill_model(args, g)
    bpt = g.pool_bytes_per_token
    read, write, latency, array_from = array_figures(args, args.page_tokens * bpt)
    for name in ("instances", "repeat", "page_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(name, f"must be >= 1, got {getattr(args, name)}")
    if args.hbm_kv_gb < 0 or args.host_kv_gb < 0:
        raise ConfigError("hbm_kv_gb" if args.hbm_kv_gb < 0 else "host_kv_gb", "must be >= 0")
    sizes = [parse_bytes(s) for s in args.l3_sizes]
    dep = Deployment(args.instances, int(args.hbm_kv_gb * 1e9 // bpt), int(args.host_kv_gb * 1e9 // bpt),
                     args.page_tokens, bpt, DeviceModel(read, latency), prefill, args.h2d_gbps * 1e9,
                     Routing(args.routing), EvictionPolicyName(args.eviction), args.prefetch_threshold)
    trace = load(args.trace, TraceFormat(args.format) if args.format else None, args.trace_block_tokens)
    if args.duration is not None:
        trace = trace.head(seconds=args.duration)
    if args.repeat > 1:
        trace = trace.repeated(args.repeat)
    steps = 2 + len(sizes) * len(args.modes)
    with console.status("replaying") as status:
        done = [0]

        def step(label: str) -> None:
            done[0] += 1
            status.update(f"replaying {len(trace.requests):,} requests: {label} done ({done[0]}/{steps})")

        result = plan(trace, dep, sizes, [PoolMode(m) for m in args.modes], progress=step, workers=args.workers)
    command = shlex.join(["sgl-kvtier", *sys.argv[1:]]) if sys.argv[1:2] == ["plan"] else "sgl-kvtier plan"
    record = result.as_dict() | {
        "command": command, "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": g.__dict__ | {"pool_bytes_per_token": bpt}, "prefill_from": prefill_from,
        "array": {"read_Bps": read, "write_Bps": write, "batch_latency_s": latency, "from": array_from},
        "advice": report.advice(result),
    }
    over = [r.name for r in result.rows if write and r.write_Bpd / 86400 > write * args.instances]
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        t = result.trace
        console.print(f"trace {t['source']}: {t['requests']:,} requests over {t['duration_s']:.0f} s, "
                      f"{t['input_tokens']:,} prompt tokens; at most {t['reusable_share']:.1%} of blocks reusable")
        console.print(f"model {g.name}: {bpt:,} L3 bytes per token; prefill {prefill_from}; array {array_from}: "
                      f"{read / 1e9:.3g} GB/s read, {latency * 1e3:.3g} ms a batch; replayed in {result.seconds:.1f} s")
        wide = console if console.is_terminal and console.width >= 160 else Console(width=160)
        wide.print(report.table(result))
        if over:
            console.print(f"[yellow]these need more flash writes than --write-gbps gives: {', '.join(over)}[/]")
        console.print(record["advice"])
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan.json").write_text(json.dumps(record, indent=2) + "\n")
        (args.out / "plan.md").write_text(f"`{command}` ({record['date']})\n\n" + report.markdown(result)
                                          + "\n" + record["advice"] + "\n")
        png = report.plot(result, args.out / "plan.png", f"{record['date']}  {command}")
        if not args.json:
            console.print(f"wrote {args.out}/plan.json, plan.md" + (", plan.png" if png else
                          " (no plan.png: pip install 'sgl-kvtier[plan]' for matplotlib)"))
    return 0
