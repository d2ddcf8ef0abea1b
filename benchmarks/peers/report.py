"""The table (markdown, also printed), the greedy-output check against recompute and the PNG of one bench_peers run.

Per system and concurrency, from the measured phases (``sgl_kvtier.serving.summary.summarize``): TTFT p50 / p99,
requests per second, prompt tokens served from storage (SGLang's ``cached_tokens_details``), from the device or
host pool, and computed; errors; at C = 1 whether every greedy output equals recompute's; the memory the system's
cgroup held (peak: resident + page cache; and the page cache no process maps, where an L3's file pages sit), the
major faults and the bytes its processes read from the disk over the measured phases, and the DRAM store a system
keeps outside SGLang's pools (what it held, where the system reports it, and its size). The PNG carries the run's
date, machine and command line.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.machine import machine_line
from benchmarks.serving.report import machine_paragraph, model_dtype, pyplot, save_figure

MB = 1e6
BASELINE = "recompute"


def levels(res: dict[str, Any]) -> list[dict[str, Any]]:
    return list(res.get("workloads", {}).get("multiturn", []))


def compare_outputs(run: dict[str, Any], concurrency: int = 1) -> None:
    """Set each system's ``outputs_vs_recompute`` at ``concurrency``: ``{"same", "compared"}`` over the requests
    both answered (greedy, so they must match token for token), or None without a recompute row at that level."""
    def outputs(name: str) -> dict[str, Any]:
        res = run["systems"].get(name, {})
        return {r["rid"]: r.get("output_ids") for lv in levels(res) if lv["concurrency"] == concurrency
                for ph in lv["phases"] for r in ph["requests"] if "error" not in r}

    base = outputs(BASELINE)
    for name, res in run["systems"].items():
        mine = outputs(name)
        both = [rid for rid in mine if rid in base and mine[rid] is not None and base[rid] is not None]
        res["outputs_vs_recompute"] = {"concurrency": concurrency, "compared": len(both),
                                       "same": sum(mine[rid] == base[rid] for rid in both),
                                       "differ": [rid for rid in both if mine[rid] != base[rid]][:10]} if both else None


def unmapped_cache(snap: dict[str, float]) -> float:
    """Page cache no process maps (files read or written: an L3's pages), of a cgroup reading: memory.stat's cache
    less mapped files (the interpreter's and torch's libraries) and shmem."""
    return max(0.0, snap["total_cache"] - snap["total_mapped_file"] - snap["total_shmem"])


def cgroup_cell(level: dict[str, Any]) -> dict[str, float]:
    """Over a level's measured phases: peak memory and page cache, major faults and bytes read from disk."""
    peak = cache = faults = read = 0.0
    seen = False
    for ph in level["phases"]:
        before, after = ph.get("probe_before") or {}, ph.get("probe_after") or {}
        if not ph["measured"] or "peak_bytes" not in before or "peak_bytes" not in after:
            continue
        seen = True
        peak = max(peak, after["peak_bytes"])
        cache = max(cache, unmapped_cache(after), unmapped_cache(before))
        faults += after["total_pgmajfault"] - before["total_pgmajfault"]
        read += max(0.0, after["read_bytes"] - before["read_bytes"])
    return {"peak_bytes": peak, "cache_bytes": cache, "majfaults": faults, "read_bytes": read} if seen else {}


def dram_used(level: dict[str, Any]) -> float | None:
    """The most a system reported its DRAM store held after a measured phase (Mooncake's allocated segment
    bytes), or None where it reports none."""
    seen = [ph["probe_after"]["dram_allocated_bytes"] for ph in level["phases"]
            if ph["measured"] and "dram_allocated_bytes" in (ph.get("probe_after") or {})]
    return max(seen) if seen else None


def rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (system, concurrency) that ran, in the run's order, lowest concurrency first."""
    out = []
    for c in run["concurrency"]:
        for name in run["system_order"]:
            res = run["systems"].get(name, {})
            for lv in levels(res):
                if lv["concurrency"] != c:
                    continue
                s = lv["summary"]
                same = res.get("outputs_vs_recompute") if c == (res.get("outputs_vs_recompute") or {}).get(
                    "concurrency") else None
                out.append({"system": name, "storage": res.get("storage", "?"), "concurrency": c, "summary": s,
                            "cgroup": cgroup_cell(lv), "same": same, "dram_store_bytes": res.get("dram_store_bytes", 0),
                            "dram_used_bytes": dram_used(lv), "error": res.get("error")})
    return out


def _fmt_tok(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 10000 else f"{n:.0f}"


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / MB:.0f}"


def dram_cell(row: dict[str, Any]) -> str:
    """``used / size`` MB of a system's DRAM store (its size alone where it reports no use; ``-``: none)."""
    size, used = row["dram_store_bytes"], row["dram_used_bytes"]
    if not size:
        return "-"
    return _mb(size) if used is None else f"{_mb(used)} / {_mb(size)}"


HEAD = ["system", "L3 in", "C", "TTFT p50 s", "p99 s", "req/s", "tok from storage", "tok from device+host",
        "tok computed", "errors", "outputs = recompute", "DRAM store MB used / size", "cgroup peak MB", "page cache MB",
        "major faults", "disk read MB"]


def table(run: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for r in rows(run):
        s, cg, same = r["summary"], r["cgroup"], r["same"]
        cached = s["cached_tokens"]
        lines.append("| " + " | ".join([
            r["system"] + (" (failed)" if r["error"] else ""), r["storage"], str(r["concurrency"]),
            f"{s['ttft_p50_s']:.2f}", f"{s['ttft_p99_s']:.2f}", f"{s['req_per_s']:.3f}",
            _fmt_tok(cached["storage"]), _fmt_tok(cached["device"] + cached["host"]), _fmt_tok(s["computed_tokens"]),
            str(s["errors"]), "-" if not same else f"{same['same']}/{same['compared']}",
            dram_cell(r),
            _mb(cg.get("peak_bytes")), _mb(cg.get("cache_bytes")),
            "-" if not cg else f"{cg['majfaults']:.0f}", _mb(cg.get("read_bytes"))]) + " |")  # fmt: skip
    return "\n".join(lines)


_CAUSE = re.compile(r"[A-Z]\w*(?:Error|Exception): [^\\\n]+")  # no \b: a repr's "\nValueError" has none


def cause(error: str) -> str:
    """The last ``SomethingError: message`` in a failure (a server's log tail ends with the real one), else its
    first 400 characters."""
    found = _CAUSE.findall(error)
    return found[-1][:400] if found else error[:400]


def skipped(run: dict[str, Any]) -> list[str]:
    out = []
    for name in run["system_order"]:
        res = run["systems"].get(name, {})
        if res.get("skipped"):
            out.append(f"- **{name}** skipped: {res['skipped']}")
        elif res.get("error"):
            out.append(f"- **{name}** failed: {cause(res['error'])}")
    return out


def versions(run: dict[str, Any]) -> list[str]:
    return [f"- **{name}**: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items())
            for name, res in run["systems"].items() if res.get("versions")]


def limits(run: dict[str, Any]) -> list[str]:
    out = []
    for name, res in run["systems"].items():
        cap = (res.get("cgroup") or {}).get("cap")
        if cap:
            oom = cap.get("oom_control", {})
            out.append(f"- **{name}**: {cap['limit_low_bytes'] / MB:.0f} to {cap['limit_high_bytes'] / MB:.0f} MB over "
                       f"{cap['updates']} updates ({cap['refused']} refused by the kernel); OOM kills "
                       f"{oom.get('oom_kill', 0)}")
    return out


def markdown(run: dict[str, Any]) -> str:
    s, cg = run["sizing"], run["cgroup"]
    info = run["workload_info"]["multiturn"]
    intro = (f"Model `{run['model']['name']}` ({model_dtype(run)}{run['model']['kv_bytes_per_token']} KV bytes/token), "
             f"{'GPU' if run['gpu'] else 'CPU'}, page {s['page_size']} tokens; device pool {s['device_tokens']} tokens, "
             f"host pool {s['host_tokens']} tokens ({s['host_pool_bytes'] / MB:.0f} MB, HiCache systems). "
             f"Workload: {info['description']}; L3 working set per level {s['working_set_bytes'] / MB:.0f} MB = "
             f"{s['working_set_bytes'] / max(1, s['host_pool_bytes']):.1f}x the host pool. Page cache: "
             f"{run['page_cache']['policy']}.")
    if cg["used"]:
        room = s["page_cache_allowance_bytes"] + s.get("margin_bytes", 0)
        mem = (f"Memory cgroup per system: its limit follows the processes' resident memory (+ "
               f"{s['page_cache_allowance_bytes'] / MB:.0f} MB allowance + {s.get('margin_bytes', 0) / MB:.0f} MB margin, "
               f"updated every 0.1 s), so the page cache no process maps never holds more than {room / MB:.0f} MB; the "
               f"L3 working set is {s['working_set_bytes'] / max(1, room):.1f}x that.")
    else:
        mem = f"No memory cgroup ({cg['why_not']}): the page cache may hold a file-based L3."
    parts = [f"# bench_peers: {run['started']}", "", f"`{run['command']}`", "", *machine_paragraph(run), intro, "",
             mem, ""]
    if cg.get("warning"):
        parts += [f"Warning: {cg['warning']}", ""]
    parts += [table(run), ""]
    if sk := skipped(run):
        parts += ["## Not measured", "", *sk, ""]
    if lim := limits(run):
        parts += ["## Memory limits (the range each cgroup's limit went through)", "", *lim, ""]
    if ver := versions(run):
        parts += ["## Versions", "", *ver, ""]
    parts += ["## Server commands", ""]
    for name, res in run["systems"].items():
        if res.get("command_str"):
            parts += [f"- **{name}** ({res['summary']}), started in {res.get('startup_s') or 0:.0f} s:",
                      f"  `{res['command_str']}`"]
            parts += [f"  - service `{' '.join(svc['command'])}`" for svc in res.get("services", [])]
    return "\n".join(parts) + "\n"


def plots(run: dict[str, Any], out: Path) -> list[Path]:
    """peers.png: TTFT p50 (bar) and p99 (tick) per system at each concurrency; where prompt tokens came from."""
    plt = pyplot()
    rs = rows(run)
    names = [n for n in run["system_order"] if any(r["system"] == n for r in rs)]
    levels_ = [c for c in run["concurrency"] if any(r["concurrency"] == c for r in rs)]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / max(1, len(levels_))
    for j, c in enumerate(levels_):
        by = {r["system"]: r["summary"] for r in rs if r["concurrency"] == c}
        xs = np.arange(len(names)) + j * width
        p50 = [by[n]["ttft_p50_s"] if n in by else np.nan for n in names]
        p99 = [by[n]["ttft_p99_s"] if n in by else np.nan for n in names]
        ax.bar(xs, p50, width, label=f"C={c} p50", color=f"C{j}")
        ax.plot(xs, p99, "_", color="black", markersize=10, label="p99" if j == 0 else None)
    ax.set_xticks(np.arange(len(names)) + width * (len(levels_) - 1) / 2, names, rotation=30, ha="right")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT per system")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    colors = {"storage": "#c44e52", "device+host": "#4c72b0", "computed": "#bbbbbb"}
    for j, c in enumerate(levels_):
        by = {r["system"]: r["summary"] for r in rs if r["concurrency"] == c}
        xs = np.arange(len(names)) + j * width
        bottom = np.zeros(len(names))
        for part, color in colors.items():
            vals = np.array([0.0 if n not in by else by[n]["cached_tokens"]["storage"] if part == "storage" else
                             by[n]["computed_tokens"] if part == "computed" else
                             by[n]["cached_tokens"]["device"] + by[n]["cached_tokens"]["host"] for n in names])
            bx.bar(xs, vals, width * 0.95, bottom=bottom, color=color, label=part if j == 0 else None)
            bottom += vals
    bx.set_xticks(np.arange(len(names)) + width * (len(levels_) - 1) / 2, names, rotation=30, ha="right")
    bx.set_ylabel("prompt tokens (measured phases)")
    bx.set_title("where prompt tokens came from (bars: C = " + ", ".join(map(str, levels_)) + ")")
    bx.legend(fontsize=8)
    fig.suptitle(caption(run), fontsize=8)
    return [save_figure(fig, out / "peers.png")]


def caption(run: dict[str, Any]) -> str:
    """What the figure carries: the run's date, the machine and the command line."""
    machine = machine_line(run["machine"]) if run.get("machine", {}).get("cpu_model") else "machine not recorded"
    return "\n".join(textwrap.wrap(f"bench_peers {run['started']}; {machine}", 180)
                     + textwrap.wrap(run["command"], 180, break_on_hyphens=False))
