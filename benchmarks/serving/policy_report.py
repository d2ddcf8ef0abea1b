"""bench_policy's tables and plot: per device setting, each policy's TTFT p50/p99 and its ratio to the
better of `recompute` and `load-all`; the target (cost <= 1.1x that, on p50 and p99) judged per level.

Cells are `sgl_kvtier.serving.summary.summarize` summaries; `run["runs"][device][policy]["levels"][str(C)]`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serving.policies import BASELINES
from benchmarks.serving.report import machine_paragraph, model_dtype, pyplot, save_figure

TARGET = 1.1
METRICS = (("ttft_p50_s", "p50"), ("ttft_p99_s", "p99"))


def cells(run: dict[str, Any], device: str) -> dict[tuple[str, int], dict[str, Any]]:
    out = {}
    for policy, res in run["runs"].get(device, {}).items():
        for c, summary in res.get("levels", {}).items():
            out[(policy, int(c))] = summary
    return out


def best(cs: dict[tuple[str, int], dict[str, Any]], c: int, key: str) -> tuple[float, str] | None:
    """The lower of the baselines' `key` at concurrency `c`, and which one it was (None: neither ran)."""
    got = [(cs[(b, c)][key], b) for b in BASELINES if (b, c) in cs and not math.isnan(cs[(b, c)][key])]
    return min(got) if got else None


def ratio(cell: dict[str, Any], base: tuple[float, str] | None, key: str) -> float | None:
    if base is None or not base[0] > 0 or math.isnan(cell[key]):
        return None
    return cell[key] / base[0]


def verdict(cell: dict[str, Any], cs: dict, c: int) -> tuple[bool | None, list[float | None]]:
    rs = [ratio(cell, best(cs, c, key), key) for key, _ in METRICS]
    if any(r is None for r in rs):
        return None, rs
    return all(r <= TARGET for r in rs), rs


def table(run: dict[str, Any], device: str) -> str:
    cs = cells(run, device)
    levels = sorted({c for _, c in cs})
    head = ["policy", "C", "TTFT p50 s", "p99 s", "p50 / best", "p99 / best", "L3 tokens used", "computed tokens",
            "L3 MB read", "unfulfilled L3 tokens", "target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in levels:
        for policy in run["policy_order"]:
            cell = cs.get((policy, c))
            if cell is None:
                continue
            ok, rs = verdict(cell, cs, c)
            target = "-" if policy != "cost" else "n/a" if ok is None else "MET" if ok else "NOT MET"
            met = cell.get("metrics", {})
            unfulfilled = sum(v for k, v in met.items() if k.startswith("unfulfilled_"))
            err = f" ({cell['errors']} err)" if cell["errors"] else ""
            lines.append("| " + " | ".join([
                policy + err, str(c), f"{cell['ttft_p50_s']:.2f}", f"{cell['ttft_p99_s']:.2f}",
                *("-" if r is None else f"{r:.2f}x" for r in rs),
                f"{cell['cached_tokens']['storage']}", f"{cell['computed_tokens']}",
                f"{cell['l3_read_gb'] * 1e3:.1f}", f"{unfulfilled:.0f}", target]) + " |")  # fmt: skip
    return "\n".join(lines)


def targets(run: dict[str, Any]) -> list[str]:
    out = []
    for dev in run["device_order"]:
        cs = cells(run, dev)
        for c in sorted({c for p, c in cs if p == "cost"}):
            ok, rs = verdict(cs[("cost", c)], cs, c)
            if ok is None:
                out.append(f"- {dev}, C={c}: not judged (neither recompute nor load-all was measured)")
                continue
            parts = []
            for (key, label), r in zip(METRICS, rs):
                b = best(cs, c, key)
                parts.append(f"{label} {cs[('cost', c)][key]:.2f} s = {r:.2f}x {b[1]} {b[0]:.2f} s")
            out.append(f"- {dev}, C={c}: {'MET' if ok else 'NOT MET'} ({'; '.join(parts)}; target <= {TARGET}x)")
    return out


def markdown(run: dict[str, Any]) -> str:
    s, w = run["sizing"], run["workload"]
    parts = [f"# bench_policy: {run['started']}", "", *machine_paragraph(run),
             (f"Model `{run['model']['name']}` ({model_dtype(run)}{run['model']['kv_bytes_per_token']} KV bytes/token), "
              f"{'GPU' if run['gpu'] else 'CPU'}, page {s['page_size']} tokens, device pool {s['device_tokens']} "
              f"tokens, host pool {s['host_tokens']} tokens; page cache: {run['page_cache']}."), "",
             f"Workload: {w['description']}", "",
             ("`p50 / best` and `p99 / best`: this policy's TTFT over the lower of recompute's and load-all's "
              f"at the same C (lower is better; target for `cost`: <= {TARGET}x on both)."), ""]
    for dev in run["device_order"]:
        parts += [f"## {dev}", "", run["devices"][dev]["description"], "", table(run, dev), ""]
    parts += ["## Target: cost <= 1.1x min(recompute, load-all), TTFT p50 and p99", "", *targets(run), "",
              "## Server commands", ""]
    for dev in run["device_order"]:
        for policy, res in run["runs"].get(dev, {}).items():
            env = " ".join(f"{k}={v}" for k, v in res.get("env", {}).items())
            parts += [f"- **{dev} / {policy}**, started in {res.get('startup_s') or 0:.0f} s"
                      + (f", FAILED: {res['error'][:300]}" if res.get("error") else "") + ":",
                      f"  `{env + ' ' if env else ''}{res.get('command_str', '')}`"]
    return "\n".join(parts) + "\n"


def plot(run: dict[str, Any], out: Path) -> Path:
    """`ttft_by_policy.png`: per device setting, TTFT p50 bars (p99 as a marker) per policy and C, and a
    dashed line at 1.1x the better baseline's p50."""
    plt = pyplot()
    devs = run["device_order"]
    fig, axes = plt.subplots(1, len(devs), figsize=(5.5 * len(devs), 4.5), squeeze=False)
    for ax, dev in zip(axes[0], devs):
        cs = cells(run, dev)
        levels = sorted({c for _, c in cs})
        policies = [p for p in run["policy_order"] if any(k[0] == p for k in cs)]
        width = 0.8 / max(1, len(policies))
        for i, policy in enumerate(policies):
            xs = np.arange(len(levels)) + (i - (len(policies) - 1) / 2) * width
            p50 = [cs[(policy, c)]["ttft_p50_s"] if (policy, c) in cs else np.nan for c in levels]
            p99 = [cs[(policy, c)]["ttft_p99_s"] if (policy, c) in cs else np.nan for c in levels]
            ax.bar(xs, p50, width, color=f"C{i}", label=f"{policy} p50")
            ax.plot(xs, p99, "v", color="black", markersize=5, label="p99" if i == 0 else None)
        for j, c in enumerate(levels):
            b = best(cs, c, "ttft_p50_s")
            if b is not None:
                ax.hlines(TARGET * b[0], j - 0.45, j + 0.45, colors="grey", linestyles="dashed",
                          label="1.1x best p50" if j == 0 else None)
        ax.set_xticks(range(len(levels)), [f"C={c}" for c in levels])
        ax.set_ylabel("TTFT (s)")
        ax.set_title(dev)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, out / "ttft_by_policy.png")
