"""Summaries, the markdown report and the PNG plots of one bench_serving run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.machine import machine_line
from sgl_kvtier.serving.summary import TIERS

BASELINES = ("radix", "recompute", "file-l3")

def _cells(run: dict[str, Any], workload: str) -> dict[tuple[str, int], dict[str, Any]]:
    out = {}
    for name, cfg in run["configs"].items():
        for level in cfg.get("workloads", {}).get(workload, []):
            out[(name, level["concurrency"])] = level["summary"]
    return out


def _fmt_tok(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 10000 else f"{n:.0f}"


def ratio(base: dict[str, Any] | None, cell: dict[str, Any], key: str = "ttft_p50_s") -> float | None:
    if base is None or not cell[key] or base is cell or np.isnan(cell[key]) or np.isnan(base[key]):
        return None
    return base[key] / cell[key]


def table(run: dict[str, Any], workload: str) -> str:
    cells = _cells(run, workload)
    order = [n for n in run["config_order"] if any(k[0] == n for k in cells)]
    levels = sorted({c for _, c in cells})
    head = ["config", "C", "TTFT p50 s", "p90 s", "p99 s", "req/s", "input tok/s", "cached device", "host",
            "storage", "computed", "L3 MB read", "L3 MB written", "server CPU s", "others' CPU s"] + [f"p50 vs {b}" for b in BASELINES]
    repeated = any(len(c.get("ttft_p50_by_repeat", [])) > 1 for c in cells.values())
    if repeated:
        head.insert(3, "p50 per run s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in levels:
        for name in order:
            cell = cells.get((name, c))
            if cell is None:
                continue
            rs = []
            for b in BASELINES:
                r = ratio(cells.get((b, c)), cell)
                rs.append("-" if r is None else f"{r:.2f}x")
            err = f" ({cell['errors']} err)" if cell["errors"] else ""
            per_run = ["/".join(f"{v:.2f}" for v in cell.get("ttft_p50_by_repeat", []))] if repeated else []
            lines.append("| " + " | ".join([
                name + err, str(c), f"{cell['ttft_p50_s']:.2f}", *per_run, f"{cell['ttft_p90_s']:.2f}",
                f"{cell['ttft_p99_s']:.2f}", f"{cell['req_per_s']:.3f}", f"{cell['input_tok_per_s']:.0f}",
                *(_fmt_tok(cell["cached_tokens"][t]) for t in TIERS), _fmt_tok(cell["computed_tokens"]),
                f"{cell['l3_read_gb'] * 1e3:.1f}", f"{cell['l3_written_gb'] * 1e3:.1f}",
                f"{cell.get('server_cpu_s', 0.0):.0f}", f"{max(0.0, cell.get('machine_busy_s', 0.0) - cell.get('server_cpu_s', 0.0)):.0f}", *rs]) + " |")  # fmt: skip
    return "\n".join(lines)


def targets(run: dict[str, Any]) -> list[str]:
    """The targets, judged on this run (reported only)."""
    cells = _cells(run, "multiturn")
    out = []
    kvheavy = run["model"]["name"] == "kvheavy"
    for (name, c), cell in sorted(cells.items(), key=lambda kv: kv[0][1]):
        if name != "kvtier-l3" or not 4 <= c <= 16:
            continue
        checks = [("radix", 1 / 0.7, ">= 30% lower than radix"), ("recompute", 2.5, ">= 2.5x lower than recompute"),
                  ("file-l3", 2.0 if kvheavy else 1.0, ">= 2x lower than file-l3" if kvheavy else "lower than file-l3")]
        for base, need, words in checks:
            r = ratio(cells.get((base, c)), cell)
            if r is None:
                out.append(f"- C={c}: TTFT p50 {words}: not measured ({base} not in this run)")
            else:
                ok = r > need if base == "file-l3" and not kvheavy else r >= need
                out.append(f"- C={c}: TTFT p50 {words}: {'MET' if ok else 'NOT MET'} "
                           f"({base} {cells[(base, c)]['ttft_p50_s']:.2f} s / kvtier-l3 {cell['ttft_p50_s']:.2f} s "
                           f"= {r:.2f}x, target {need:.2f}x)")
    return out


def model_dtype(run: dict[str, Any]) -> str:
    """``float32, auto: ...; `` for a report's model sentence, or nothing for a run that recorded no dtype."""
    m = run.get("model", {})
    return f"{m['dtype']}, {m.get('dtype_source') or '?'}; " if m.get("dtype") else ""


def machine_paragraph(run: dict[str, Any]) -> list[str]:
    """The report header's machine line (and a blank line), or nothing for a run that recorded none."""
    return [f"Machine: {machine_line(run['machine'])}.", ""] if run.get("machine", {}).get("cpu_model") else []


def markdown(run: dict[str, Any]) -> str:
    s = run["sizing"]
    intro = (f"Model `{run['model']['name']}` ({model_dtype(run)}{run['model']['kv_bytes_per_token']} KV bytes/token), "
             f"{'GPU' if run['gpu'] else 'CPU'}, page {s['page_size']} tokens. Device pool "
             f"{s['device_tokens']} tokens, host pool {s['host_tokens']} tokens (HiCache configs); "
             f"page cache: {run['page_cache']['policy']}.")
    parts = [f"# bench_serving: {run['started']}", "", *machine_paragraph(run), intro, ""]
    for wl in run["workloads"]:
        spill = (f"Unique prefix tokens per concurrency level (cumulative after each phase): "
                 f"{run['workload_info'][wl]['unique_prefix_tokens_cumulative']}, vs device+host capacity "
                 f"{s['device_tokens'] + s['host_tokens']} tokens.")
        parts += [f"## {wl}", "", run["workload_info"][wl]["description"], "", spill, "", table(run, wl), ""]
    tgt = targets(run)
    if tgt:
        parts += ["## Targets (multiturn, C=4..16)", "", *tgt, ""]
    parts += ["## Server commands", ""]
    for name, cfg in run["configs"].items():
        starts = ", ".join(f"{r.get('startup_s') or 0:.0f}" for r in cfg.get("runs", [])) or "-"
        parts += [f"- **{name}** ({cfg['summary']}), started in {starts} s"
                  + (f", FAILED: {cfg['error'][:300]}" if cfg.get("error") else "") + ":",
                  f"  `{cfg['command_str']}`"]
    return "\n".join(parts) + "\n"


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write as PNG, and release ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def plots(run: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()
    written = []
    wls = run["workloads"]
    fig, axes = plt.subplots(1, len(wls), figsize=(6 * len(wls), 4.5), squeeze=False)
    for ax, wl in zip(axes[0], wls):
        cells = _cells(run, wl)
        for i, name in enumerate(n for n in run["config_order"] if any(k[0] == n for k in cells)):
            xs = sorted(c for n, c in cells if n == name)
            color = f"C{i}"
            ax.plot(xs, [cells[(name, c)]["ttft_p50_s"] for c in xs], "o-", color=color, label=f"{name} p50")
            ax.plot(xs, [cells[(name, c)]["ttft_p99_s"] for c in xs], "s--", color=color, alpha=0.6,
                    label=f"{name} p99")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{wl}: TTFT vs concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    written.append(save_figure(fig, out / "ttft_vs_concurrency.png"))

    fig, axes = plt.subplots(1, len(wls), figsize=(6 * len(wls), 4.5), squeeze=False)
    colors = {"device": "#4c72b0", "host": "#55a868", "storage": "#c44e52", "computed": "#bbbbbb"}
    for ax, wl in zip(axes[0], wls):
        cells = _cells(run, wl)
        keys = sorted(cells, key=lambda k: (k[1], run["config_order"].index(k[0])))
        labels = [f"{n}\nC={c}" for n, c in keys]
        bottom = np.zeros(len(keys))
        for tier in (*TIERS, "computed"):
            vals = np.array([cells[k]["computed_tokens"] if tier == "computed" else cells[k]["cached_tokens"][tier]
                             for k in keys], dtype=float)
            ax.bar(range(len(keys)), vals, bottom=bottom, color=colors[tier], label=tier)
            bottom += vals
        ax.set_xticks(range(len(keys)), labels, fontsize=7, rotation=45, ha="right")
        ax.set_ylabel("prompt tokens (measured phases)")
        ax.set_title(f"{wl}: where prompt tokens came from")
        ax.legend(fontsize=8)
    written.append(save_figure(fig, out / "hit_tokens_by_tier.png"))
    return written
