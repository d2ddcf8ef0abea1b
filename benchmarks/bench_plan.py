"""sgl-kvtier plan against a real serving run: the planner's predictions for the very requests a bench_peers
run sent, next to what the servers measured.

The trace is the run's own: each concurrency level's multi-turn requests, rebuilt from the workload's seed,
arriving when they were sent, cut into the servers' pages. The planner's inputs are the run's sizing (HBM and
host pools, page size, KV bytes per token, the L3 capacity) and figures measured in the run itself, never the
figures it predicts: prefill seconds fitted (``sgl_kvtier.policy.cost_model.PrefillEstimator``) on the
forwards of the ``--prefill-from`` system (``recompute``: every prompt token computed), and the read path
fitted (``sgl_kvtier.estimation.TransferEstimator``) on the storage waits of the system under test, unless
``--read-gbps`` gives it. Compared over the measured rounds (round 1 is the warm-up): the share of prompt
tokens served from cache and TTFT p50 / p99. Targets: hit share within 5 points, TTFT p50 within 25%.

    python -m benchmarks.bench_plan --run benchmarks/results/peers-<time>       # kvtier vs its prediction
    python -m benchmarks.bench_plan --run DIR --system file --read-gbps 0.5

Writes <run>/plan-check.json, plan-check.md and plan-check.png (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_peers import parse_args as peers_args
from benchmarks.peers.system import NONE
from benchmarks.serving import workloads
from sgl_kvtier.estimation import DeviceModel, TransferEstimator
from sgl_kvtier.plan.replay import Deployment, PoolMode, Routing, cacheable_sizes, l3_pass, local_pass, timeline
from sgl_kvtier.plan.trace import Trace, TraceRequest, chain_blocks, ordered
from sgl_kvtier.policy.cost_model import PrefillEstimator, PrefillModel

HIT_POINTS = 5.0  # targets: predicted hit share within 5 points of the measured one
TTFT_RATIO = 0.25  # and TTFT p50 within 25%


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="a bench_peers output directory (its results.json)")
    p.add_argument("--system", default="kvtier", help="the system whose measurements are predicted")
    p.add_argument("--prefill-from", default="recompute", help="the system whose forwards fit the prefill model")
    p.add_argument("--read-gbps", type=float, help="the L3 read bandwidth (default: fitted on the run's waits)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="with --read-gbps: fixed cost per batch")
    p.add_argument("--h2d-gbps", type=float, default=10.0, help="host pool to device pool copy rate")
    p.add_argument("--l3-gb", type=float, help="the L3's capacity (default: the run's --kvtier-capacity-gb)")
    p.add_argument("--out", type=Path, help="default: the run's directory")
    return p.parse_args(argv)


def level_trace(run: dict[str, Any], level: dict[str, Any], lo_hi: tuple[int, int]) -> tuple[Trace, list[str]]:
    """The level's requests as a planner trace (arrival = when the run sent each) and their rids in its order."""
    params = run["workload_info"]["multiturn"]["params"]
    wl = workloads.multiturn(workloads.TokenSource(*lo_hi, salt=level["salt"]), **params)
    tokens = {r.rid: r.tokens for r in wl.requests}
    sent = {rq["rid"]: rq for ph in level["phases"] for rq in ph["requests"]}
    page = run["sizing"]["page_size"]
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    reqs = [(rid, TraceRequest(rq["sent_at"], len(tokens[rid]), rq.get("completion_tokens") or 0,
                               chain_blocks(tokens[rid], page, ids))) for rid, rq in sent.items()]
    reqs.sort(key=lambda x: x[1].arrival_s)
    return ordered([r for _, r in reqs], page, f"{run['command']} C={level['concurrency']}"), [rid for rid, _ in reqs]


def fit_prefill(system: dict[str, Any]) -> PrefillModel:
    """Prefill seconds fitted on every request's forward at the lowest concurrency (one request a forward)."""
    est = PrefillEstimator(half_life=1e9, min_samples=2)
    level = min(system["workloads"]["multiturn"], key=lambda lv: lv["concurrency"])
    for ph in level["phases"]:
        for rq in ph["requests"]:
            fwd = (rq.get("phases") or {}).get("forward_s")
            cached = rq.get("cached_tokens") or 0
            if fwd and rq.get("prompt_tokens"):
                est.record(rq["prompt_tokens"] - cached, cached, fwd)
    model = est.model()
    if model is None:
        raise SystemExit("bench_plan: too few forwards to fit the prefill model")
    return model


def fit_read(system: dict[str, Any], bpt: int) -> DeviceModel:
    """The L3 read path fitted on the storage waits of requests that loaded from it."""
    est = TransferEstimator(half_life=1e9)
    for level in system["workloads"]["multiturn"]:
        for ph in level["phases"]:
            for rq in ph["requests"]:
                wait = (rq.get("phases") or {}).get("prefetch_wait_s")
                if rq.get("cached_storage") and wait:
                    est.record(rq["cached_storage"] * bpt, wait)
    model = est.model()
    if model is None:
        raise SystemExit("bench_plan: no storage hits to fit the read path on; give --read-gbps")
    return model


def check_level(run: dict[str, Any], system: dict[str, Any], level: dict[str, Any], dep: Deployment,
                l3_bytes: float, lo_hi: tuple[int, int]) -> dict[str, Any]:
    trace, rids = level_trace(run, level, lo_hi)
    sizes = cacheable_sizes(trace, dep.page_tokens)
    flushes = []
    if run["page_cache"].get("flush_between_phases"):  # the run emptied HBM and host memory before each measured
        t0 = min(rq["sent_at"] for ph in level["phases"] for rq in ph["requests"])  # phase but the first
        flushes = [min(rq["sent_at"] for rq in ph["requests"]) - t0 for ph in level["phases"][1:]]
    local = local_pass(trace, dep, sizes, flushes=flushes)
    l3 = l3_pass(trace, dep, sizes, local, l3_bytes, PoolMode.SHARED) if dep.host_tokens else None
    storage = l3.storage_tokens if l3 is not None else np.zeros(len(rids), np.int64)
    cached = local.device_tokens + local.host_tokens + storage
    tl = timeline(trace, dep, local.instance, cached, storage, local.host_tokens)
    measured_rq = {rq["rid"]: rq for ph in level["phases"] if ph["measured"] for rq in ph["requests"]}
    idx = [i for i, rid in enumerate(rids) if rid in measured_rq]
    m = [measured_rq[rids[i]] for i in idx]
    prompt = sum(r["prompt_tokens"] for r in m)
    measured_hit = sum(r["cached_device"] + r["cached_host"] + r["cached_storage"] for r in m) / prompt
    predicted_hit = float(cached[idx].sum()) / prompt
    mt = np.array([r["ttft_s"] for r in m])
    pt = tl.ttft_s[idx]
    out = {"concurrency": level["concurrency"], "requests": len(idx),
           "measured": {"hit_share": measured_hit, "ttft_p50_s": float(np.median(mt)),
                        "ttft_p99_s": float(np.percentile(mt, 99)),
                        "by_tier": {t: sum(r[f"cached_{t}"] for r in m) / prompt for t in ("device", "host", "storage")}},
           "predicted": {"hit_share": predicted_hit, "ttft_p50_s": float(np.median(pt)),
                         "ttft_p99_s": float(np.percentile(pt, 99)),
                         "by_tier": {t: float(v[idx].sum()) / prompt for t, v in
                                     (("device", local.device_tokens), ("host", local.host_tokens),
                                      ("storage", storage))}},
           "per_request": [{"rid": rids[i], "measured_ttft_s": float(a), "predicted_ttft_s": float(b)}
                           for i, a, b in zip(idx, mt, pt)]}
    out["hit_points"] = 100 * (predicted_hit - measured_hit)
    out["ttft_p50_ratio"] = out["predicted"]["ttft_p50_s"] / out["measured"]["ttft_p50_s"]
    out["passed"] = abs(out["hit_points"]) <= HIT_POINTS and abs(out["ttft_p50_ratio"] - 1) <= TTFT_RATIO
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [f"`{result['command']}` ({result['date']}); the run: `{result['run_command']}`", "",
             f"Prefill fitted on `{result['prefill_from']}`: {result['prefill']}; read path "
             f"{result['read']['from']}: {result['read']['bandwidth_Bps'] / 1e9:.3g} GB/s, "
             f"{result['read']['batch_latency_s'] * 1e3:.3g} ms a batch.", "",
             "| C | requests | hit share measured | predicted | points | TTFT p50 measured s | predicted s | ratio "
             "| TTFT p99 measured s | predicted s | within targets |", "|" + "---|" * 11]
    for lv in result["levels"]:
        m, p = lv["measured"], lv["predicted"]
        lines.append(f"| {lv['concurrency']} | {lv['requests']} | {m['hit_share']:.1%} | {p['hit_share']:.1%} | "
                     f"{lv['hit_points']:+.1f} | {m['ttft_p50_s']:.3g} | {p['ttft_p50_s']:.3g} | "
                     f"{lv['ttft_p50_ratio']:.2f} | {m['ttft_p99_s']:.3g} | {p['ttft_p99_s']:.3g} | "
                     f"{'yes' if lv['passed'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    fig, axes = plt.subplots(1, len(levels), figsize=(4.5 * len(levels), 4.2), squeeze=False)
    for ax, lv in zip(axes[0], levels):
        mt = [r["measured_ttft_s"] for r in lv["per_request"]]
        pt = [r["predicted_ttft_s"] for r in lv["per_request"]]
        ax.scatter(mt, pt, s=12)
        top = max(mt + pt) * 1.05
        ax.plot([0, top], [0, top], color="gray", lw=1, ls=":")
        ax.set_xlabel("measured TTFT, s")
        ax.set_ylabel("predicted TTFT, s")
        ax.set_title(f"C = {lv['concurrency']}: hit {lv['measured']['hit_share']:.0%} measured, "
                     f"{lv['predicted']['hit_share']:.0%} predicted", fontsize=9)
        ax.grid(True, alpha=0.3)
    fig.text(0.01, 0.01, f"{result['date']}  {result['machine']}  {result['command']}", fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = json.loads((args.run / "results.json").read_text())
    system = run["systems"].get(args.system)
    base = run["systems"].get(args.prefill_from)
    if not system or not system.get("workloads") or not base or not base.get("workloads"):
        raise SystemExit(f"bench_plan: {args.run} has no measurements of {args.system} and {args.prefill_from}")
    sizing, bpt = run["sizing"], run["model"]["kv_bytes_per_token"]
    prefill = fit_prefill(base)
    if args.read_gbps:
        read, read_from = DeviceModel(args.read_gbps * 1e9, args.latency_ms / 1e3), "given"
    else:
        read, read_from = fit_read(system, bpt), f"fitted on {args.system}'s storage waits"
    hicache = system.get("storage") != NONE  # in bench_peers the systems without an L3 run no HiCache either
    dep = Deployment(1, sizing["device_tokens"], sizing["host_tokens"] if hicache else 0, sizing["page_size"], bpt,
                     read, prefill, args.h2d_gbps * 1e9, Routing.ROUND_ROBIN)
    l3_bytes = args.l3_gb * 1e9 if args.l3_gb else peers_args(run["argv"]).kvtier_capacity_gb * 1e9
    lo_hi = workloads.token_range(Path(run["model"]["path"]))
    levels = [check_level(run, system, lv, dep, l3_bytes, lo_hi) for lv in system["workloads"]["multiturn"]]
    m = run["machine"]
    result = {"command": " ".join(["python -m benchmarks.bench_plan", *(argv if argv is not None else sys.argv[1:])]),
              "date": datetime.now(UTC).isoformat(timespec="seconds"), "run": str(args.run),
              "run_command": run["command"], "system": args.system, "prefill_from": args.prefill_from,
              "machine": f"{m.get('cpu_model')}, {m.get('cores')} cores, {m.get('mem_gib')} GiB",
              "prefill": {"per_token_s": prefill.per_token_s, "per_token_kctx_s": prefill.per_token_kctx_s,
                          "fixed_s": prefill.fixed_s},
              "read": {"bandwidth_Bps": read.bandwidth_Bps, "batch_latency_s": read.batch_latency_s,
                       "from": read_from},
              "l3_bytes": l3_bytes, "targets": {"hit_points": HIT_POINTS, "ttft_p50_ratio": TTFT_RATIO},
              "levels": levels}
    out = args.out or args.run
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan-check.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / "plan-check.md").write_text(text)
    plot(result, out / "plan-check.png")
    print(text)
    return 0 if all(lv["passed"] for lv in levels) else 1


if __name__ == "__main__":
    raise SystemExit(main())
