"""``bench_cluster``'s results: one summary per writer count (``summarize``), the markdown report with its table
(``table``, ``markdown``) and ``cluster.png`` (``plot``: follow cost against the number of writers).

A summary, over every lookup of every writer of one run: ``hit_rate`` per kind (``fresh``: right after the
round's puts, visible once each writer's lease announced them; ``settled``: once every writer saw every
other's pages of the round; ``own``: a writer alone), ``wrong`` (pages served with other bytes than were
put: must be 0), the visibility lag (from the end of a round's puts until every writer saw all of them,
p50 over the rounds), and per refresh (one forced refresh before each lookup) its time (p50, p90), files
opened and bytes read (means), and the lookup's own time after it (``longest_prefix`` and ``get``, p50).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.machine import machine_line
from benchmarks.serving.report import pyplot, save_figure

KINDS = ("settled", "fresh", "own")
HEAD = ["writers", "hosts", "lookups", "hit rate, settled", "hit rate, fresh", "wrong pages", "visible after ms",
        "refresh p50 ms", "refresh p90 ms", "files / refresh", "KiB / refresh", "lookup p50 ms"]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(lookups: list[dict[str, Any]], writers: int, hosts: int, lags: list[float]) -> dict[str, Any]:
    """One run's figures (module docstring) from its lookup records (``pool_worker``'s ``lookups``) and the
    visibility lag of each round (seconds)."""
    if not lookups:
        raise ValueError("no lookups to summarize")
    rates: dict[str, float | None] = {}
    for kind in KINDS:
        mine = [r for r in lookups if r["kind"] == kind]
        asked = sum(r["asked"] for r in mine)
        rates[kind] = sum(r["hits"] for r in mine) / asked if asked else None
    refresh_s = [r["refresh_s"] for r in lookups]
    return {
        "writers": writers, "hosts": hosts, "lookups": len(lookups),
        "pages_asked": sum(r["asked"] for r in lookups), "hit_rate": rates,
        "wrong": sum(r["wrong"] for r in lookups), "misses": sum(r["misses"] for r in lookups),
        "visible_p50_ms": 1e3 * _quantile(lags, 0.5) if lags else None,
        "refresh_p50_ms": 1e3 * _quantile(refresh_s, 0.5), "refresh_p90_ms": 1e3 * _quantile(refresh_s, 0.9),
        "refresh_files": statistics.fmean(r["refresh_files"] for r in lookups),
        "refresh_kib": statistics.fmean(r["refresh_bytes"] for r in lookups) / 1024,
        "lookup_p50_ms": 1e3 * _quantile([r["lookup_s"] for r in lookups], 0.5),
    }  # fmt: skip


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def table(summaries: list[dict[str, Any]]) -> str:
    """The markdown table: one row per writer count (``HEAD``)."""
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for s in summaries:
        settled = s["hit_rate"]["settled"] if s["writers"] > 1 else s["hit_rate"]["own"]
        lines.append("| " + " | ".join([
            str(s["writers"]), str(s["hosts"]), str(s["lookups"]), _rate(settled), _rate(s["hit_rate"]["fresh"]),
            str(s["wrong"]), "-" if s["visible_p50_ms"] is None else f"{s['visible_p50_ms']:.0f}",
            f"{s['refresh_p50_ms']:.1f}", f"{s['refresh_p90_ms']:.1f}", f"{s['refresh_files']:.1f}",
            f"{s['refresh_kib']:.1f}", f"{s['lookup_p50_ms']:.1f}"]) + " |")  # fmt: skip
    return "\n".join(lines)


def markdown(run: dict[str, Any]) -> str:
    """The whole report: header (date, command, machine, lab, workload), the table, what it says."""
    a = run["args"]
    summaries = run["summaries"]
    parts = [f"# bench_cluster: {run['started']}", "", f"Command: `{run['command']}`", "",
             f"Machine: {machine_line(run['machine'])}.", "",
             f"Lab: {a['hosts']} hosts (network namespaces) mounting one JuiceFS volume (metadata and data in "
             f"redis across a bridge; JuiceFS {run.get('juicefs', '?')}); writers placed round-robin over the "
             "hosts, each a process of its host with its own `SharedPool` writer (`sharing = \"cluster\"`).", "",
             f"Workload per writer count: {a['rounds']} rounds; each round every writer puts {a['pages']} pages of "
             f"{a['page_kib']} KiB (one chain); then looks up {a['lookups']} chains of {a['lookup_pages']} pages of "
             "the other writers' chains of the round right away (fresh), and again once every writer sees every "
             "other's pages of the round (settled); each lookup after a forced refresh of its pool, metered. "
             f"heartbeat_s {a['heartbeat_s']}, follow_interval_s {a['follow_interval_s']}.", "",
             table(summaries), ""]
    wrong = sum(s["wrong"] for s in summaries)
    parts.append(f"Wrong pages over all runs: {wrong}" + (" (every page read was checked byte for byte)."
                                                          if wrong == 0 else " - A FAILURE."))
    most = max(summaries, key=lambda s: s["writers"])
    if most["writers"] > 1:
        peers = most["writers"] - 1
        parts += ["", f"Follow cost per other writer ({most['writers']} writers): a refresh opens "
                      f"{most['refresh_files'] / peers:.1f} files and reads {most['refresh_kib'] / peers:.1f} KiB."]
    load = run.get("loadavg")
    if load:
        parts += ["", f"Load average (1 min) at the start and at the end of the run: {load['start']:.1f} / "
                      f"{load['end']:.1f}, on {run['machine'].get('cores', '?')} cores."]
    return "\n".join(parts) + "\n"


def plot(run: dict[str, Any], path: Path) -> Path:
    """``cluster.png``: per writer count, the refresh's p50 time, and its files opened and KiB read."""
    plt = pyplot()
    s = run["summaries"]
    n = [x["writers"] for x in s]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(n, [x["refresh_p50_ms"] for x in s], "o-", label="p50")
    ax1.plot(n, [x["refresh_p90_ms"] for x in s], "s--", label="p90")
    ax1.set_xlabel("writers in the pool")
    ax1.set_ylabel("ms per refresh")
    ax1.set_title("refresh time (one per lookup)")
    ax1.set_xticks(n)
    ax1.legend(fontsize=8)
    ax1.grid(True, alpha=0.3)
    ax2.plot(n, [x["refresh_files"] for x in s], "o-", color="#55a868", label="files opened")
    ax2.set_xlabel("writers in the pool")
    ax2.set_ylabel("files opened per refresh", color="#55a868")
    ax2.set_xticks(n)
    ax2.grid(True, alpha=0.3)
    twin = ax2.twinx()
    twin.plot(n, [x["refresh_kib"] for x in s], "s--", color="#c44e52", label="KiB read")
    twin.set_ylabel("KiB read per refresh", color="#c44e52")
    ax2.set_title("what one refresh reads")
    fig.suptitle(f"bench_cluster, {run['started']}: {run['args']['hosts']} JuiceFS hosts", fontsize=10)
    return save_figure(fig, path)
