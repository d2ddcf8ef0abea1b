"""gpu_stream's table, markdown and plot. A result's ``cells`` are one per (geometry, host layout, device, G):
medians over the repetitions of each timed path (``pipeline``), their ratio, and whether the device KV was
byte-equal to the pages written after a load (``verified``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.machine import machine_line
from benchmarks.serving.report import pyplot, save_figure

HEAD = ["geometry", "layout", "device", "G", "read s (L3->host)", "H2D s", "compute s (device hit)",
        "load-all s (a)", "streamed s (b)", "b/a", "ideal max(read, compute) s", "b/ideal", "compute waited s",
        "verified"]


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def row(c: Mapping[str, Any]) -> list[str]:
    m = c.get("median", {})
    if c.get("skipped"):
        return [c["geometry"], c["layout"], c["device"], str(c["groups"]), f"skipped: {c['skipped']}",
                *["-"] * (len(HEAD) - 5)]
    a, b = m.get("load_all_s"), m.get("streamed_s")
    ideal = max(m["read_s"], m["compute_s"]) if m.get("read_s") is not None and m.get("compute_s") else None
    return [c["geometry"], c["layout"], c["device"], str(c["groups"]), _s(m.get("read_s")), _s(m.get("h2d_s")),
            _s(m.get("compute_s")), _s(a), _s(b), f"{b / a:.2f}" if a and b else "-", _s(ideal),
            f"{b / ideal:.2f}" if b and ideal else "-", _s(m.get("waited_s")),
            "yes" if c.get("verified") else "NO" if c.get("verified") is False else "-"]


def table(result: Mapping[str, Any]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(row(c)) + " |" for c in result["cells"]]
    return "\n".join(lines)


def markdown(result: Mapping[str, Any]) -> str:
    parts = [f"# gpu_stream: {result['started']}", "", f"Machine: {machine_line(result['machine'])}.", "",
             f"Mode: {result['mode']}; compute dtype {result['compute_dtype']}; {result['reps']} repetitions per "
             f"path (medians); store direct IO: {result.get('direct_io')}; page cache: {result['page_cache']}.", "",
             "(a) load-all: every page read whole into pinned host memory, then per-layer copies overlapped with "
             "the layers. (b) streamed: group-major `get_parts`, each verified group copied and computed while "
             "later groups read. Lower b/a is better; b/ideal near 1 means the read hid under the compute "
             "(or the reverse).", ""]
    for name, g in result["geometries"].items():
        parts.append(f"- `{name}`: {g['note']}; {g['layers']} layers, page {g['page_tokens']} tokens = "
                     f"{g['page_bytes'] / 2**10:.0f} KiB, prefix {g['prefix_tokens']} tokens = "
                     f"{g['prefix_bytes'] / 1e6:.1f} MB, suffix {g['suffix_tokens']} tokens, "
                     f"{g['layer_gflop']:.2f} GFLOP per layer")
    for name, b in result.get("breakeven", {}).items():
        parts.append(f"- break-even `{name}`: " + (b["note"] if "note" in b else
                     f"compute {b['compute_s']:.3f} s, fast reads {b['fast_read_bytes_per_s'] / 1e9:.2f} GB/s; "
                     f"reads throttled to {b['read_bytes_per_s'] / 1e9:.2f} GB/s ({b.get('source', 'derived')})"))
    parts += ["", table(result), ""]
    if result.get("notes"):
        parts += ["Notes:", "", *[f"- {n}" for n in result["notes"]], ""]
    return "\n".join(parts) + "\n"


def plot(result: Mapping[str, Any], out: Path) -> Path:
    """``gpu_stream.png``: per (geometry, layout, device), (a) and (b) per G, compute-only and read-only as lines."""
    plt = pyplot()
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for c in result["cells"]:
        if not c.get("skipped"):
            groups.setdefault((c["geometry"], c["layout"], c["device"]), []).append(c)
    keys = list(groups) or [("none", "", "")]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        cells = groups.get(key, [])
        xs = np.arange(len(cells))
        med = [c["median"] for c in cells]
        ax.bar(xs - 0.2, [m.get("load_all_s", np.nan) for m in med], 0.4, color="C0", label="(a) load-all")
        ax.bar(xs + 0.2, [m.get("streamed_s", np.nan) for m in med], 0.4, color="C1", label="(b) streamed")
        if med:
            ax.axhline(med[0].get("compute_s", np.nan), color="grey", linestyle="dashed", label="compute only")
            ax.axhline(float(np.nanmedian([m.get("read_s", np.nan) for m in med])), color="grey", linestyle="dotted",
                       label="read only")
        ax.set_xticks(xs, [f"G={c['groups']}" for c in cells])
        ax.set_ylabel("TTFT-like time (s)")
        ax.set_title(" / ".join(k for k in key if k), fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, out / "gpu_stream.png")
