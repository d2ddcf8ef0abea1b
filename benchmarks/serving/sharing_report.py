"""bench_sharing's summaries, the targets judged on one run, the markdown report and the PNG.

Targets, on the measured phases (rounds 2..R; round 1 is the warm-up):
- ``kvtier-shared`` serves >= 1.5x the cached prompt tokens of ``kvtier-per-instance``;
- ``kvtier-shared``'s TTFT p50 is >= 25% lower than ``kvtier-per-instance``'s;
- ``kvtier-shared``'s TTFT p50 is lower than ``file-shared``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serving import report
from sgl_kvtier.serving import summary

SHARED, PER_INSTANCE, FILE = "kvtier-shared", "kvtier-per-instance", "file-shared"
CACHED_RATIO, TTFT_CUT = 1.5, 0.25


def summarize(phases: list[dict[str, Any]], kv_bytes_per_token: int) -> dict[str, Any]:
    """bench_serving's cell summary of the measured phases, plus cached prompt tokens in all."""
    s = summary.summarize(phases, kv_bytes_per_token)
    ok = [r for p in phases if p["measured"] for r in p["requests"] if "error" not in r]
    s["cached_total"] = sum(int(r.get("cached_tokens", 0)) for r in ok)
    return s


def _cell(run: dict[str, Any], name: str) -> dict[str, Any] | None:
    cfg = run.get("configs", {}).get(name) or {}
    s = cfg.get("summary")
    return s if s and s.get("requests", 0) > s.get("errors", 0) else None


def _finite(x: float | None) -> bool:
    return x is not None and bool(np.isfinite(x))


def ratios(run: dict[str, Any]) -> dict[str, float | None]:
    """The figures the targets judge (None where a configuration is missing or failed)."""
    shared, per, file = _cell(run, SHARED), _cell(run, PER_INSTANCE), _cell(run, FILE)
    out: dict[str, float | None] = {"cached_shared_vs_per_instance": None, "ttft_p50_cut_vs_per_instance": None,
                                    "ttft_p50_file_over_shared": None, "cached_file_vs_per_instance": None}
    if shared and per:
        out["cached_shared_vs_per_instance"] = shared["cached_total"] / per["cached_total"] if per["cached_total"] else None
        if _finite(per["ttft_p50_s"]) and _finite(shared["ttft_p50_s"]) and per["ttft_p50_s"] > 0:
            out["ttft_p50_cut_vs_per_instance"] = 1 - shared["ttft_p50_s"] / per["ttft_p50_s"]
    if shared and file and _finite(file["ttft_p50_s"]) and _finite(shared["ttft_p50_s"]) and shared["ttft_p50_s"] > 0:
        out["ttft_p50_file_over_shared"] = file["ttft_p50_s"] / shared["ttft_p50_s"]
    if file and per and per["cached_total"]:
        out["cached_file_vs_per_instance"] = file["cached_total"] / per["cached_total"]
    return out


def targets(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target: its words, the measured value, the threshold, and met (None: not measured)."""
    r = ratios(run)
    cells = {n: _cell(run, n) for n in (SHARED, PER_INSTANCE, FILE)}

    def detail(key: str, fmt: str, names: tuple[str, ...]) -> str:
        return ", ".join(f"{n} {fmt.format(cells[n][key])}" for n in names if cells[n] is not None)

    rows = [
        {"target": f"cached prompt tokens, {SHARED} / {PER_INSTANCE} >= {CACHED_RATIO}x",
         "value": r["cached_shared_vs_per_instance"], "need": CACHED_RATIO, "unit": "x",
         "detail": detail("cached_total", "{:,}", (SHARED, PER_INSTANCE))},
        {"target": f"TTFT p50 of {SHARED} >= {TTFT_CUT:.0%} lower than {PER_INSTANCE}",
         "value": r["ttft_p50_cut_vs_per_instance"], "need": TTFT_CUT, "unit": "%",
         "detail": detail("ttft_p50_s", "{:.2f} s", (SHARED, PER_INSTANCE))},
        {"target": f"TTFT p50 of {SHARED} lower than {FILE} ({FILE} / {SHARED} > 1)",
         "value": r["ttft_p50_file_over_shared"], "need": 1.0, "unit": "x", "strict": True,
         "detail": detail("ttft_p50_s", "{:.2f} s", (SHARED, FILE))},
    ]
    for row in rows:
        v = row["value"]
        row["met"] = None if v is None else (v > row["need"] if row.get("strict") else v >= row["need"])
    return rows


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.0%}" if unit == "%" else f"{v:.2f}x"


def table(run: dict[str, Any]) -> str:
    head = ["config", "L3", "frontend", "requests", "prompt tokens", "cached tokens", "of which storage", "hit rate",
            "TTFT p50 s", "p99 s", "req/s", "input tok/s", "turns switched", "server CPU s", "others' CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in run["config_order"]:
        cfg = run["configs"].get(name, {})
        s = cfg.get("summary")
        where = cfg.get("l3_where", "-")
        front = (cfg.get("frontend") or {}).get("kind", "-")
        if not s:
            lines.append("| " + " | ".join([name, where, front, "FAILED" if cfg.get("error") else "-"] + ["-"] * 11) + " |")
            continue
        alt = cfg.get("alternation", {})
        switched = f"{alt['switched']}/{alt['transitions']}" if alt.get("transitions") else "-"
        err = f" ({s['errors']} err)" if s["errors"] else ""
        lines.append("| " + " | ".join([
            name, where, front, f"{s['requests']}{err}", f"{s['prompt_tokens']:,}", f"{s['cached_total']:,}",
            f"{s['cached_tokens']['storage']:,}", f"{s['hit_rate']:.0%}", f"{s['ttft_p50_s']:.2f}",
            f"{s['ttft_p99_s']:.2f}", f"{s['req_per_s']:.3f}", f"{s['input_tok_per_s']:.0f}", switched,
            f"{s.get('server_cpu_s', 0.0):.0f}",
            f"{max(0.0, s.get('machine_busy_s', 0.0) - s.get('server_cpu_s', 0.0)):.0f}"]) + " |")  # fmt: skip
    return "\n".join(lines)


def markdown(run: dict[str, Any]) -> str:
    s = run["sizing"]
    parts = [f"# bench_sharing: {run['started']}", "", *report.machine_paragraph(run)]
    parts += [f"Model `{run['model']['name']}` ({report.model_dtype(run)}{run['model']['kv_bytes_per_token']} KV "
              f"bytes/token), {'GPU' if run['gpu'] else 'CPU'}; two instances per configuration"
              f"{', each pinned to ' + run['pinning_words'] if run.get('pinning_words') else ''}; page "
              f"{s['page_size']} tokens, device pool {s['device_tokens']} tokens and host pool {s['host_tokens']} "
              f"tokens per instance (HiCache configs); page cache: {run['page_cache']['policy']}.", "",
              f"Workload: {run['workload_info']['description']}; concurrency {run['concurrency']} at the front. "
              f"Working set per instance (predicted round-robin): {s['per_worker_unique_tokens']} tokens vs "
              f"max(device, host) {max(s['device_tokens'], s['host_tokens'])}. Upper bounds of cached tokens in "
              f"the measured rounds (no eviction): shared {s['ideal_cached']['shared']:,}, per instance "
              f"{s['ideal_cached']['per_instance']:,}.", ""]
    parts += ["## Results (measured rounds)", "", table(run), ""]
    parts += ["## Targets", ""]
    for t in targets(run):
        verdict = "not measured" if t["met"] is None else ("MET" if t["met"] else "NOT MET")
        parts.append(f"- {t['target']}: **{verdict}** ({_fmt(t['value'], t['unit'])}"
                     f"{'; ' + t['detail'] if t['detail'] else ''})")
    extra = ratios(run)["cached_file_vs_per_instance"]
    if extra is not None:
        parts.append(f"- (for reference) cached prompt tokens, {FILE} / {PER_INSTANCE}: {extra:.2f}x")
    parts += ["", "## Servers and routers", ""]
    for name in run["config_order"]:
        cfg = run["configs"].get(name, {})
        front = cfg.get("frontend") or {}
        reason = f" (fallback: {front['reason']})" if front.get("reason") else ""
        parts.append(f"- **{name}** ({cfg.get('summary_text', '')}); front: {front.get('kind', '-')}{reason}"
                     + (f"; FAILED: {cfg['error'][:300]}" if cfg.get("error") else ""))
        for inst in cfg.get("instances", []):
            parts.append(f"  - instance {inst['index']} (started in {inst.get('startup_s') or 0:.0f} s): "
                         f"`{inst['command_str']}`")
        if front.get("router"):
            parts.append(f"  - router: `{front['router']['command_str']}`")
    return "\n".join(parts) + "\n"


def plots(run: dict[str, Any], out: Path) -> list[Path]:
    """``sharing.png``: TTFT p50/p99 and where the measured prompt tokens came from, per configuration."""
    plt = report.pyplot()
    names = [n for n in run["config_order"] if (run["configs"].get(n) or {}).get("summary")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(names))
    cells = [run["configs"][n]["summary"] for n in names]
    ax1.bar(x - 0.2, [c["ttft_p50_s"] for c in cells], 0.4, label="p50", color="#4c72b0")
    ax1.bar(x + 0.2, [c["ttft_p99_s"] for c in cells], 0.4, label="p99", color="#dd8452")
    ax1.set_xticks(x, names, fontsize=8, rotation=20, ha="right")
    ax1.set_ylabel("TTFT (s)")
    ax1.set_title("TTFT, measured rounds")
    ax1.legend(fontsize=8)
    ax1.grid(True, axis="y", alpha=0.3)
    colors = {"device": "#4c72b0", "host": "#55a868", "storage": "#c44e52", "computed": "#bbbbbb"}
    bottom = np.zeros(len(names))
    for tier in (*summary.TIERS, "computed"):
        vals = np.array([c["computed_tokens"] if tier == "computed" else c["cached_tokens"][tier] for c in cells],
                        dtype=float)
        ax2.bar(x, vals, bottom=bottom, color=colors[tier], label=tier)
        bottom += vals
    ax2.set_xticks(x, names, fontsize=8, rotation=20, ha="right")
    ax2.set_ylabel("prompt tokens (measured rounds)")
    ax2.set_title("cached prompt tokens by tier, and computed")
    ax2.legend(fontsize=8)
    return [report.save_figure(fig, out / "sharing.png")]
