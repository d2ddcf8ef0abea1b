"""The plan as a person reads it: a table (terminal and Markdown), a PNG, and one sentence of advice.

Advice rule: the smallest shared L3 whose TTFT p50 is within ``NEAR_BEST`` of the best L3 row's; offload
pays when it cuts TTFT p50 against ``HBM + host`` by at least ``PAYS``, else the sentence says it does not.
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from sgl_kvtier.plan.planner import PlanResult, Row, human_bytes

NEAR_BEST = 0.05
PAYS = 0.10
COLUMNS = ("configuration", "from HBM", "from host", "from L3", "TTFT p50 s", "TTFT p99 s",
           "L3 read GB/s (peak s)", "flash written TB/day", "L3 evictions")


def cells(r: Row) -> list[str]:
    return [r.name, f"{r.device_share:.1%}", f"{r.host_share:.1%}", f"{r.storage_share:.1%}",
            f"{r.ttft_p50_s:.3g}", f"{r.ttft_p99_s:.3g}", f"{r.peak_read_Bps / 1e9:.2f}",
            f"{r.write_Bpd / 1e12:.2f}", f"{r.evicted_blocks:,}"]


def table(result: PlanResult) -> Table:
    t = Table(title="sgl-kvtier plan: share of prompt tokens by tier, TTFT, L3 traffic")
    for i, name in enumerate(COLUMNS):
        t.add_column(name, justify="left" if i == 0 else "right")
    for r in result.rows:
        t.add_row(*cells(r))
    return t


def markdown(result: PlanResult) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in result.rows]
    return "\n".join(lines) + "\n"


def advice(result: PlanResult) -> str:
    """One sentence: which L3 size to buy, what it does, or that offload does not pay here."""
    base = result.row("HBM + host")
    shared = [r for r in result.rows if r.mode == "shared"]
    even = f" Loading beats recomputing from {result.break_even_tokens:,} prompt tokens on this array." \
        if result.break_even_tokens else " On this array loading never beats recomputing a prefix."
    if not shared:
        return "No L3 size was given." + even
    best = min(r.ttft_p50_s for r in shared)
    pick = min((r for r in shared if r.ttft_p50_s <= best * (1 + NEAR_BEST)), key=lambda r: r.l3_bytes)
    gain = 1 - pick.ttft_p50_s / base.ttft_p50_s if base.ttft_p50_s > 0 else 0.0
    if gain < PAYS or pick.storage_share <= 0:
        top = max(shared, key=lambda r: r.storage_share)
        return (f"Offload does not pay for this trace: the largest L3 ({top.name}) serves {top.storage_share:.1%} "
                f"of prompt tokens, and no size moves TTFT p50 from {base.ttft_p50_s:.3g} s below "
                f"{best:.3g} s." + even)
    return (f"Take {human_bytes(pick.l3_bytes)} of shared L3: it serves {pick.storage_share:.1%} of prompt tokens "
            f"from flash and cuts TTFT p50 from {base.ttft_p50_s:.3g} s to {pick.ttft_p50_s:.3g} s "
            f"({base.ttft_p50_s / pick.ttft_p50_s:.2f}x) and p99 from {base.ttft_p99_s:.3g} s to "
            f"{pick.ttft_p99_s:.3g} s; it needs {pick.peak_read_Bps / 1e9:.1f} GB/s of reads at the trace's "
            f"busiest second and writes {pick.write_Bpd / 1e12:.1f} TB a day." + even)


def plot(result: PlanResult, path: Path, caption: str) -> Path | None:
    """Hit share and TTFT p50 / p99 against the L3 size (both modes), baselines as lines; None without
    matplotlib (``pip install 'sgl-kvtier[plan]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.8))
    for mode, style in (("shared", "o-"), ("per_instance", "s--")):
        rows = sorted((r for r in result.rows if r.mode == mode), key=lambda r: r.l3_bytes)
        if not rows:
            continue
        x = [r.l3_bytes / 1e12 for r in rows]
        label = mode.replace("_", " ")
        ax_hit.plot(x, [100 * r.hit_share for r in rows], style, label=f"all tiers, L3 {label}")
        ax_hit.plot(x, [100 * r.storage_share for r in rows], style, alpha=0.6, label=f"from L3, {label}")
        ax_ttft.plot(x, [r.ttft_p50_s for r in rows], style, label=f"p50, L3 {label}")
        ax_ttft.plot(x, [r.ttft_p99_s for r in rows], style, alpha=0.6, label=f"p99, L3 {label}")
    for name, color in (("HBM", "tab:red"), ("HBM + host", "tab:gray")):
        r = result.row(name)
        ax_hit.axhline(100 * r.hit_share, color=color, lw=1, ls=":", label=name)
        ax_ttft.axhline(r.ttft_p50_s, color=color, lw=1, ls=":", label=f"{name} p50")
    for ax in (ax_hit, ax_ttft):
        ax.set_xscale("log")
        ax.set_xlabel("L3 size, TB (all instances)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax_hit.set_ylabel("prompt tokens served from cache, %")
    ax_ttft.set_ylabel("TTFT, s")
    ax_ttft.set_yscale("log")
    fig.suptitle("sgl-kvtier plan", fontsize=11)
    fig.text(0.01, 0.01, caption, fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
