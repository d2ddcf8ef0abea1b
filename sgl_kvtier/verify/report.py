"""A verification as a person reads it: the arms' table, the gates' table, markdown, and a PNG; every figure
with the command line, date and host it came from."""

from __future__ import annotations

import os
import platform
import shlex
from pathlib import Path
from typing import Any

from rich.table import Table

from sgl_kvtier.serving.hardware import has_cuda_gpu
from sgl_kvtier.serving.summary import TIERS

ARM_COLUMNS = ("arm", "C", "TTFT p50 s", "TTFT p99 s", "req/s", "from HBM", "from host", "from L3", "computed",
               "errors", "same output")


def host_line() -> str:
    """This host: CPU model, cores, memory, GPU (the client's; a started server's too)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.1f} GiB"
    except OSError:
        mem = "memory unknown"
    return f"{model}, {os.cpu_count()} cores, {mem}, GPU {'yes' if has_cuda_gpu() else 'none'}"


def _share(n: float, total: float) -> str:
    return f"{n / total:.0%}" if total else "-"


def arm_rows(run: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, arm in run["arms"].items():
        if arm.get("error") and not arm.get("levels"):
            rows.append([name, "-", *["-"] * 8, "failed"])
            continue
        for c, level in arm.get("levels", {}).items():
            s = level["summary"]
            prompt = s["prompt_tokens"]
            same = level.get("same_output")
            rows.append([name, c, f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p99_s']:.3f}", f"{s['req_per_s']:.3f}",
                         *(_share(s["cached_tokens"][t], prompt) for t in TIERS), _share(s["computed_tokens"], prompt),
                         str(s["errors"]), f"{same[0]}/{same[1]}" if same else "-"])
    return rows


def gate_rows(run: dict[str, Any]) -> list[list[str]]:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.1%}"

    rows = []
    for g in run["verdicts"]:
        if g["gate"] == "error_rate":
            rows.append([g["gate"], str(g["concurrency"]), "-", "-" if g["value"] is None else f"{g['value']:.1%}",
                         f"<= {run['gates']['max_error_rate']:.1%}", g["verdict"].upper()])
            continue
        rows.append([g["gate"], str(g["concurrency"]), "-" if g["baseline"] is None else f"{g['baseline']:.3f}",
                     "-" if g["value"] is None else f"{g['value']:.3f}", f"{pct(g['achieved'])} (>= {pct(g['required'])})",
                     g["verdict"].upper()])
    return rows


GATE_COLUMNS = ("gate", "C", "baseline", "l3", "gain (required)", "verdict")


def tables(run: dict[str, Any]) -> tuple[Table, Table]:
    arms = Table(title="sgl-kvtier verify: the same prompts on each arm (measured phases)")
    for i, col in enumerate(ARM_COLUMNS):
        arms.add_column(col, justify="left" if i == 0 else "right")
    for row in arm_rows(run):
        arms.add_row(*row)
    gates = Table(title=f"gates: {run['under_test']} against {run['baseline']}")
    for i, col in enumerate(GATE_COLUMNS):
        gates.add_column(col, justify="left" if i == 0 else "right")
    for row in gate_rows(run):
        gates.add_row(*row, style="green" if row[-1] == "PASS" else "red")
    return arms, gates


def _md(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *("| " + " | ".join(r) + " |" for r in rows)]


def caption(run: dict[str, Any]) -> str:
    return f"`{run['command']}` ({run['started']}; {run['host']})"


def markdown(run: dict[str, Any]) -> str:
    lines = [f"# sgl-kvtier verify: {'PASSED' if run['passed'] else 'FAILED'}", "", caption(run), "",
             f"Workload: {run['workload']['description']}.", ""]
    for name, arm in run["arms"].items():
        serving = arm.get("serving", {})
        where = f"started: `{shlex.join(serving['command'])}`" if serving.get("command") else \
            f"endpoints {', '.join(serving.get('urls', []))}"
        lines.append(f"- **{name}**: {where}" + (f"; failed: {arm['error']}" if arm.get("error") else ""))
    lines += ["", *_md(ARM_COLUMNS, arm_rows(run)), "",
              f"Gates ({run['under_test']} against {run['baseline']}):", "", *_md(GATE_COLUMNS, gate_rows(run)), ""]
    return "\n".join(lines)


def plot(run: dict[str, Any], path: Path) -> Path | None:
    """TTFT p50 / p99 and request throughput against concurrency per arm, and prompt tokens by tier; None
    without matplotlib (``pip install 'sgl-kvtier[plan]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax_ttft, ax_rps, ax_tier) = plt.subplots(1, 3, figsize=(15, 4.6))
    bars: list[tuple[str, dict[str, Any]]] = []
    levels_seen: set[int] = set()
    for name, arm in run["arms"].items():
        levels = arm.get("levels", {})
        if not levels:
            continue
        cs = [int(c) for c in levels]
        levels_seen.update(cs)
        ss = [lv["summary"] for lv in levels.values()]
        line = ax_ttft.plot(cs, [s["ttft_p50_s"] for s in ss], "o-", label=f"{name} p50")[0]
        ax_ttft.plot(cs, [s["ttft_p99_s"] for s in ss], "s--", color=line.get_color(), alpha=0.6, label=f"{name} p99")
        ax_rps.plot(cs, [s["req_per_s"] for s in ss], "o-", color=line.get_color(), label=name)
        bars += [(f"{name}\nC={c}", s) for c, s in zip(cs, ss)]
    bottom = [0.0] * len(bars)
    for tier, color in (("device", "tab:green"), ("host", "tab:blue"), ("storage", "tab:purple"), ("computed", "tab:gray")):
        vals = [100 * (s["computed_tokens"] if tier == "computed" else s["cached_tokens"][tier]) / max(1, s["prompt_tokens"])
                for _, s in bars]
        ax_tier.bar(range(len(bars)), vals, bottom=bottom, color=color,
                    label={"device": "HBM", "storage": "L3"}.get(tier, tier))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_tier.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax_tier.set_ylabel("prompt tokens, %")
    ax_tier.legend(fontsize=7)
    for ax, label in ((ax_ttft, "TTFT s"), (ax_rps, "requests/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels_seen), [str(c) for c in sorted(levels_seen)])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"sgl-kvtier verify: {'passed' if run['passed'] else 'FAILED'} "
                 f"({run['under_test']} against {run['baseline']})", fontsize=11)
    fig.text(0.5, 0.005, caption(run).replace("`", ""), ha="center", fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
