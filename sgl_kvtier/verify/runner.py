"""Play a workload on an arm's endpoints, one concurrency level after another, and sum each level up.

Every arm gets the same prompts: level ``i`` uses the salt ``salt + i``, so each level starts cold in every
tier and a run's prompts are new to a deployment that served earlier runs. Before each measured phase the
arm's L3 write-back is waited for (``/metrics``' backed-up tokens unchanged), and with ``flush`` HBM and host
memory are emptied (``POST /flush_cache``) so that the prefixes of earlier phases can only come from the L3.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sgl_kvtier.serving import client, summary
from sgl_kvtier.serving.workload import Workload
from sgl_kvtier.verify.arms import post


@dataclass(frozen=True)
class Settings:
    """How levels are played: drain L3 write-back for at most ``backup_wait_s`` between phases; ``flush``
    empties HBM and host memory before each measured phase (every arm alike)."""

    backup_wait_s: float = 30.0
    flush: bool = False


def counters(urls: Sequence[str]) -> dict[str, float]:
    """``/metrics`` counters summed over the endpoints."""
    total: dict[str, float] = {}
    for url in urls:
        for k, v in client.counters(client.scrape(url)).items():
            total[k] = total.get(k, 0.0) + v
    return total


def settle(urls: Sequence[str], settings: Settings, l3: bool) -> dict[str, Any]:
    """Before a measured phase: L3 write-back drained (an L3 arm), then the flush if asked."""
    out: dict[str, Any] = {}
    if l3:
        out["backups"] = [client.wait_backups(u, 0.0, settings.backup_wait_s) for u in urls]
    if settings.flush:
        out["flush_status"] = [post(u, "/flush_cache") for u in urls]
    return out


def play_level(urls: Sequence[str], wl: Workload, concurrency: int, settings: Settings, *, l3: bool,
               kv_bytes_per_token: int, on_done: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every phase of ``wl`` at ``concurrency``; the level's phases and its summary (measured phases only)."""
    phases: list[dict[str, Any]] = []
    for pi, phase in enumerate(wl.phases):
        settled = settle(urls, settings, l3) if pi > 0 else {}
        before = counters(urls)
        recs, wall = client.run_phase(list(urls), phase, concurrency, on_done)
        phases.append({"phase": pi, "measured": pi > 0, "settle": settled, "wall_s": wall,
                       "metrics_delta": client.delta(counters(urls), before), "requests": recs})
    return {"concurrency": concurrency, "phases": phases,
            "summary": summary.summarize(phases, kv_bytes_per_token)}


def same_outputs(level: dict[str, Any], base: dict[str, Any] | None) -> tuple[int, int] | None:
    """(requests whose greedy output equals the baseline's, requests compared) over the measured phases."""
    if base is None:
        return None

    def outputs(lv: dict[str, Any]) -> dict[str, Any]:
        return {r["rid"]: r.get("output_ids") for p in lv["phases"] if p["measured"] for r in p["requests"]
                if "error" not in r}

    mine, theirs = outputs(level), outputs(base)
    common = [rid for rid in mine if rid in theirs]
    return sum(mine[r] == theirs[r] for r in common), len(common)
