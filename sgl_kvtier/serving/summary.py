"""One cell of a serving measurement (an endpoint, a workload, a concurrency) summed up from its phases'
per-request records (``client.stream_generate``) and ``/metrics`` deltas: TTFT percentiles, throughput,
prompt tokens by the tier that served them, L3 traffic."""

from __future__ import annotations

from typing import Any

import numpy as np

from sgl_kvtier.serving.client import PHASES

TIERS = ("device", "host", "storage")


def summarize(phases: list[dict[str, Any]], kv_bytes_per_token: int) -> dict[str, Any]:
    """One (config, workload, concurrency) cell from its measured phases (phase 0, the warm-up, excluded)."""
    measured = [p for p in phases if p["measured"]]
    recs = [r for p in measured for r in p["requests"]]
    ok = [r for r in recs if "error" not in r]
    wall = sum(p["wall_s"] for p in measured)
    ttft = np.array([r["ttft_s"] for r in ok]) if ok else np.array([np.nan])
    met = {k: sum(p["metrics_delta"].get(k, 0.0) for p in measured) for k in measured[0]["metrics_delta"]} \
        if measured and measured[0]["metrics_delta"] else {}
    all_met = {k: sum(p["metrics_delta"].get(k, 0.0) for p in phases) for k in met}
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = {t: sum(r[f"cached_{t}"] for r in ok) for t in TIERS}
    return {
        "requests": len(recs), "errors": len(recs) - len(ok), "wall_s": wall,
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
        "ttft_p99_s": float(np.percentile(ttft, 99)), "ttft_mean_s": float(np.mean(ttft)),
        "latency_p50_s": float(np.median([r["latency_s"] for r in ok])) if ok else float("nan"),
        "req_per_s": len(ok) / wall if wall else 0.0, "input_tok_per_s": prompt / wall if wall else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - sum(cached.values()),
        "hit_rate": sum(cached.values()) / prompt if prompt else 0.0,
        "metrics": met,
        "server_cpu_s": sum(p.get("cpu", {}).get("server_s", 0.0) for p in measured),
        "machine_busy_s": sum(p.get("cpu", {}).get("machine_busy_s", 0.0) for p in measured),
        "l3_read_gb": met.get("prefetched_tokens", 0.0) * kv_bytes_per_token / 1e9,
        "l3_written_gb": met.get("backuped_tokens", 0.0) * kv_bytes_per_token / 1e9,
        "l3_written_gb_incl_warmup": all_met.get("backuped_tokens", 0.0) * kv_bytes_per_token / 1e9,
        "phases_p50_s": phase_medians(ok),
    }  # fmt: skip


def phase_medians(records: list[dict[str, Any]]) -> dict[str, float]:
    """Per phase of ``client.phases_of``, the median over the records that carry phases (empty if none)."""
    timed = [r["phases"] for r in records if "phases" in r]
    return {k: float(np.median([ph[k] for ph in timed])) for k in PHASES} if timed else {}
