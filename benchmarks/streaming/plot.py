"""``ttft_streaming.png``: per device, the L3-hit TTFT p50 bars (p99 as markers) with streaming off and on per
concurrency, the reference server's device-hit and recompute p50 as dashed and dotted marks; and a last panel
with on/off p50 per device against C (and twin / off, dashed, where ``--twin`` ran), with the targets' bounds
(0.80, 0.90, 1.05) as grey lines."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serving.report import pyplot, save_figure
from benchmarks.streaming.cells import cell, levels, server_keys, twin_key
from benchmarks.streaming.plan import TWIN_KEY
from benchmarks.streaming.report import TARGETS, ratio

NAME = "ttft_streaming.png"


def plot(run: Mapping[str, Any], out: Path) -> Path:
    plt = pyplot()
    devices = list(run["device_order"])
    fig, axes = plt.subplots(1, len(devices) + 1, figsize=(5 * (len(devices) + 1), 4.5), squeeze=False)
    ref = run.get("references") or {}
    for ax, device in zip(axes[0], devices):
        cs = levels(run, device)
        modes = server_keys(run, device)
        width = 0.8 / max(1, len(modes))
        for i, mode in enumerate(modes):
            xs = np.arange(len(cs)) + (i - (len(modes) - 1) / 2) * width
            p50 = [(cell(run, device, mode, "l3", c) or {}).get("ttft_p50_s", np.nan) for c in cs]
            p99 = [(cell(run, device, mode, "l3", c) or {}).get("ttft_p99_s", np.nan) for c in cs]
            ax.bar(xs, p50, width, color=f"C{i}", label=f"streaming {mode} p50")
            ax.plot(xs, p99, "v", color="black", markersize=5, label="p99" if i == 0 else None)
        for j, c in enumerate(cs):
            for level, style, label in (("device", "dashed", "device hit p50"), ("recompute", "dotted", "recompute p50")):
                x = cell(run, ref.get("device", ""), ref.get("streaming", "off"), level, c) if ref else None
                if x is not None:
                    ax.hlines(x["ttft_p50_s"], j - 0.45, j + 0.45, colors="grey", linestyles=style,
                              label=label if j == 0 else None)
        ax.set_xticks(range(len(cs)), [f"C={c}" for c in cs])
        ax.set_ylabel("L3-hit TTFT (s)")
        ax.set_title(device)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    for i, device in enumerate(devices):
        cs = levels(run, device)
        ax.plot(cs, [ratio(run, device, c) or np.nan for c in cs], "o-", color=f"C{i + 2}", label=device)
        twin = twin_key(run, device)
        if twin:
            ax.plot(cs, [ratio(run, device, c, mode=twin) or np.nan for c in cs], "x--", color=f"C{i + 2}",
                    label=f"{device}: {twin} / off" + (" (noise floor)" if twin == TWIN_KEY else ""))
    for t in TARGETS:
        ax.axhline(t.bound, color="grey", linestyle="dashed", linewidth=0.8)
    ax.set_xlabel("concurrency C")
    ax.set_ylabel("TTFT p50, streaming on / off")
    ax.set_xticks(sorted({c for d in devices for c in levels(run, d)}) or [1])
    ax.set_title("on / off TTFT p50 (grey: 0.80, 0.90, 1.05)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out / NAME)
