"""bench_streaming's tables and targets: per device, the L3-hit TTFT with streaming off and on at each
concurrency, their ratio, whether the outputs were identical, and the streaming counters; the reference
cells (device hit, recompute); the targets judged on the run (reported, never asserted).

Cells are ``sgl_kvtier.serving.summary.summarize`` summaries plus ``stream`` (the phases' summed streaming counters):
``run["servers"][device][mode]["levels"][level][str(C)]``, level ``l3`` / ``device`` / ``recompute``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks.serving.report import machine_paragraph, model_dtype
from benchmarks.streaming.bounds import ceiling, ceiling_line
from benchmarks.streaming.caveats import capped, fallbacks, few_streamed, unfulfilled
from benchmarks.streaming.cells import Cell, cell, levels, server_keys, twin_key
from benchmarks.streaming.outputs import all_identical, attributable, document
from benchmarks.streaming.plan import BREAKEVEN, ON_TWIN, PAIRED_RECORDS, twin_of
from sgl_kvtier.serving.client import PHASES


@dataclass(frozen=True)
class Target:
    """on/off TTFT p50 at most ``bound`` on the devices ``applies`` accepts, at C = ``concurrency`` (None: all)."""

    words: str
    bound: float
    concurrency: int | None
    kind: str  # "breakeven", "fast" or "any": which devices

    def applies(self, device: str, spec: str, c: int) -> bool:
        if self.concurrency is not None and c != self.concurrency:
            return False
        if self.kind == "any":
            return True
        return spec == self.kind if self.kind == BREAKEVEN else device == self.kind


TARGETS = (
    Target("break-even device, C = 1: L3-hit TTFT p50 >= 20% lower (on/off <= 0.80)", 0.80, 1, BREAKEVEN),
    Target("fast device, C = 1: L3-hit TTFT p50 >= 10% lower (on/off <= 0.90)", 0.90, 1, "fast"),
    Target("every device and C: never more than 5% worse (on/off <= 1.05)", 1.05, None, "any"),
)


def ratio(run: Mapping[str, Any], device: str, c: int, key: str = "ttft_p50_s", mode: str = "on",
          base: str = "off") -> float | None:
    """``mode`` (streaming on, or a twin) / ``base`` of ``key`` at C = ``c`` (lower is better), or None when
    either is missing."""
    off, on = cell(run, device, base, "l3", c), cell(run, device, mode, "l3", c)
    if off is None or on is None or not off[key] > 0 or math.isnan(on[key]):
        return None
    return float(on[key] / off[key])


def _fmt(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


def _identical(run: Mapping[str, Any], device: str, c: int, record: str = "identical") -> str:
    got = run.get(record, {}).get(device, {}).get(str(c))
    if not got:
        return "-"
    text = f"{got['identical']}/{got['compared']}"
    return text + (f" ({got['missing']} missing)" if got["missing"] else "")


def _stream(c: Cell) -> str:
    parts = [f"{k.removeprefix('stream_')}={v:g}" for k, v in sorted(c.get("stream", {}).items())
             if k.startswith("stream") and v]
    return ", ".join(parts) or "-"


def _counter(c: Cell, key: str) -> str:
    v = c.get("stream", {}).get(key)
    return "-" if v is None else f"{v:g}"


def paired_text(run: Mapping[str, Any], device: str, c: int, mode: str = "on", base: str = "off") -> str:
    """``median (rounds a-b)`` of the paired ``mode`` / ``base`` ratios (``streaming.paired``,
    ``plan.PAIRED_RECORDS``), ``-`` when none."""
    got = run.get(PAIRED_RECORDS.get((base, mode), ""), {}).get(device, {}).get(str(c))
    if not got:
        return "-"
    rr = got["round_ratios"]
    spread = f" (rounds {min(rr):.2f}-{max(rr):.2f})" if len(rr) > 1 else ""
    return f"{got['median_ratio']:.2f}{spread}"


def table(run: Mapping[str, Any], device: str) -> str:
    head = ["streaming", "C", "TTFT p50 s", "p99 s", "on/off p50", "on/off p99", "paired on/off", "L3 tokens", "unfulfilled L3 tokens",
            "computed tokens", "identical outputs", "stream counters", "parts read", "parts failed", "retracted",
            "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in levels(run, device):
        for mode in server_keys(run, device):
            x = cell(run, device, mode, "l3", c)
            if x is None:
                continue
            vs_off = mode != "off"
            same = {"on": "identical", ON_TWIN: "identical_twin"}.get(mode)  # streaming servers' outputs
            lines.append("| " + " | ".join([
                mode, str(c), f"{x['ttft_p50_s']:.2f}", f"{x['ttft_p99_s']:.2f}",
                _fmt(ratio(run, device, c, mode=mode)) if vs_off else "-",
                _fmt(ratio(run, device, c, "ttft_p99_s", mode)) if vs_off else "-",
                paired_text(run, device, c, mode) if vs_off else "-",
                str(x["cached_tokens"]["storage"]), f"{unfulfilled(x):.0f}", str(x["computed_tokens"]),
                _identical(run, device, c, same) if same else "-", _stream(x), _counter(x, "parts_read"),
                _counter(x, "parts_failed"), _counter(x, "retracted_requests"), str(x["errors"])]) + " |")  # fmt: skip
    return "\n".join(lines)


def bind_lines(run: Mapping[str, Any], device: str) -> list[str]:
    """The on server's bind rule figures after its last measured round of each C (``counters.bind``)."""
    out = []
    for c in levels(run, device):
        x = cell(run, device, "on", "l3", c)
        b = (x or {}).get("bind") or {}
        if not b:
            continue
        k = b.get("bind_interference_seconds_per_megabyte")
        w, xb = _fit_text(b, "whole_wait"), _fit_text(b, "load_back")
        out.append(f"- C={c}, bind rule after the last round: whole-load wait W = {w} "
                   f"({b.get('bind_whole_samples', 0):.0f} samples); interference k = "
                   + ("not learned" if k is None else f"{k * 1e3:.2f} ms/MB")
                   + f" ({b.get('bind_interference_samples', 0):.0f} samples); load-back X = {xb} "
                   f"({b.get('bind_load_back_samples', 0):.0f} samples); measured over compute: "
                   + "; ".join(f"{path} {_per_mb_text(b, f'bind_measured_{path}_seconds_per_megabyte')} "
                               f"({b.get(f'bind_measured_{path}_hits', 0):.0f} hits)" for path in ("whole", "stream")))
    return out


def _per_mb_text(bind: Mapping[str, float], name: str) -> str:
    per_mb = bind.get(name)
    return "not learned" if per_mb is None else f"{per_mb * 1e3:.2f} ms/MB"


def _fit_text(bind: Mapping[str, float], name: str) -> str:
    """``fixed s + per-MB ms/MB`` of the bind rule's fit ``name`` (``whole_wait``, ``load_back``)."""
    fixed, per_mb = bind.get(f"bind_{name}_fixed_seconds"), bind.get(f"bind_{name}_seconds_per_megabyte")
    return "not learned" if fixed is None or per_mb is None else f"{fixed:.3f} s + {per_mb * 1e3:.2f} ms/MB"


def phase_table(run: Mapping[str, Any], device: str) -> str:
    """Where the TTFT went (``client.phases_of``, p50 of each phase) for the L3 hits with streaming off and on,
    and the device hits of the reference server when it ran on this device; "" when no cell has phases."""
    rows = [(f"L3 hit, streaming {mode}", mode, "l3", c) for c in levels(run, device)
            for mode in server_keys(run, device)]
    ref = run.get("references") or {}
    if ref.get("device") == device:
        rows += [("device hit (L1/L2)", ref["streaming"], "device", c) for c in levels(run, device, "device")]
    lines = []
    for name, mode, level, c in rows:
        x = cell(run, device, mode, level, c)
        if x is None or not x.get("phases_p50_s"):
            continue
        ph = x["phases_p50_s"]
        lines.append(f"| {name} | {c} | {x['ttft_p50_s']:.2f} | " + " | ".join(f"{ph[k]:.3f}" for k in PHASES)
                     + f" | {sum(ph.values()):.2f} |")
    if not lines:
        return ""
    head = ["requests", "C", "TTFT p50 s", *(k.removesuffix("_s").replace("_", " ") + " s" for k in PHASES),
            "sum of p50s"]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *lines])


def thread_table(run: Mapping[str, Any], device: str) -> str:
    """CPU ms per measured L3 request by thread group (``thread_cpu_s`` of the cells, over their requests),
    one row per server and C, groups as columns (busiest first), and the row's total; "" without figures."""
    rows = [(mode, c, x) for c in levels(run, device) for mode in server_keys(run, device)
            if (x := cell(run, device, mode, "l3", c)) and x.get("thread_cpu_s") and x.get("requests")]
    if not rows:
        return ""
    busy: dict[str, float] = {}
    for _, _, x in rows:
        for k, v in x["thread_cpu_s"].items():
            busy[k] = busy.get(k, 0.0) + v / x["requests"]
    groups = [k for k, v in sorted(busy.items(), key=lambda kv: -kv[1]) if v >= 0.0005]
    lines = ["| " + " | ".join(["streaming", "C", *groups, "total"]) + " |", "|" + "---|" * (len(groups) + 3)]
    for mode, c, x in rows:
        per = {k: 1e3 * v / x["requests"] for k, v in x["thread_cpu_s"].items()}
        lines.append(f"| {mode} | {c} | " + " | ".join(f"{per.get(k, 0.0):.0f}" for k in groups)
                     + f" | {sum(per.values()):.0f} |")
    return "\n".join(lines)


def reference_table(run: Mapping[str, Any]) -> str:
    ref = run.get("references")
    if not ref:
        return "(no reference server in this run)"
    device, mode = ref["device"], ref["streaming"]
    head = ["reference", "C", "TTFT p50 s", "p99 s", "device tokens", "host tokens", "L3 tokens", "computed tokens",
            "L3 off p50 / this p50", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for level, name in (("device", "device hit (L1/L2)"), ("recompute", "recompute")):
        for c in levels(run, device, level):
            x = cell(run, device, mode, level, c)
            if x is None:
                continue
            l3 = cell(run, device, "off", "l3", c)
            vs = _fmt(l3["ttft_p50_s"] / x["ttft_p50_s"]) if l3 and x["ttft_p50_s"] > 0 else "-"
            t = x["cached_tokens"]
            lines.append(f"| {name} | {c} | {x['ttft_p50_s']:.2f} | {x['ttft_p99_s']:.2f} | {t['device']} | "
                         f"{t['host']} | {t['storage']} | {x['computed_tokens']} | {vs} | {x['errors']} |")
    return "\n".join(lines)


def targets(run: Mapping[str, Any]) -> list[str]:
    """One line per target and (device, C) it applies to: MET / NOT MET with the figures, or why not judged."""
    out = []
    for t in TARGETS:
        judged = []
        for device in run["device_order"]:
            spec = run["devices"][device]["spec"]
            for c in levels(run, device):
                if not t.applies(device, spec, c):
                    continue
                r = ratio(run, device, c)
                if r is None:
                    judged.append(f"{device} C={c}: not measured (off or on missing)")
                    continue
                off, on = cell(run, device, "off", "l3", c), cell(run, device, "on", "l3", c)
                assert off is not None and on is not None
                fell = " [on recomputed L3 hits: see the warning]" if on["cached_tokens"]["storage"] < \
                    off["cached_tokens"]["storage"] else ""
                pair = paired_text(run, device, c)
                judged.append(f"{device} C={c}: {'MET' if r <= t.bound else 'NOT MET'} (on {on['ttft_p50_s']:.2f} s "
                              f"/ off {off['ttft_p50_s']:.2f} s = {r:.2f}"
                              + (f"; paired {pair}" if pair != "-" else "") + f"){fell}")
        out.append(f"- {t.words}: " + ("; ".join(judged) if judged else "not measured in this run"))
    same = {d: all_identical(run.get("identical", {}).get(d, {})) for d in run["device_order"]}
    words = "; ".join(f"{d}: {'yes' if v else 'NO' if v is False else 'not compared'}" for d, v in same.items())
    out.append(f"- outputs identical on/off (greedy): {words}")
    out += control_lines(run) + twin_lines(run) + ceiling_lines(run)
    fell_back = fallbacks(run)
    if fell_back:
        out.append("- WARNING, streaming on recomputed L3 hits that off loaded (its TTFT there is no streaming "
                   "figure): " + "; ".join(fell_back))
    held = capped(run)
    if held:
        out.append("- WARNING, hits loaded whole because the withheld cap was full (the host pool is too small for "
                   "them to stream: a larger --host-ratio): " + "; ".join(held))
    few = few_streamed(run)
    if few:
        out.append("- WARNING, streaming servers that streamed under half of their hits (the rest loaded whole: "
                   "there on/off compares mostly the same path on both servers, the noise floor's reading, no "
                   "streaming figure): " + "; ".join(few))
    return out


def ceiling_lines(run: Mapping[str, Any]) -> list[str]:
    """Per device at C = 1, how low on/off can read by the off server's own phases (``bounds``; at C > 1 the
    L3 wait holds the other requests' loads too)."""
    tokens = run["workload"].get("doc_tokens")  # absent from older runs: no landing figure then
    hit_mb = None if tokens is None else tokens * run["model"]["kv_bytes_per_token"] / 1e6
    found = [(d, x) for d in run["device_order"] if 1 in levels(run, d)
             and (off := cell(run, d, "off", "l3", 1)) and (x := ceiling(off, cell(run, d, "on", "l3", 1), hit_mb))]
    return [f"  - {ceiling_line(d, 1, x)}" for d, x in found]


def control_lines(run: Mapping[str, Any]) -> list[str]:
    """The write round's outputs compared as the control (``outputs`` module docstring), per device."""
    lines = []
    for device, control in run.get("identical_control", {}).items():
        cells = list(control.values())
        same, total = sum(c["identical"] for c in cells), sum(c["compared"] for c in cells)
        unequal = sorted({document(rid) for c in cells for rid in c["different"]})
        left = attributable(run.get("identical", {}).get(device, {}), control)
        lines.append(f"  - {device}, control (write round, computed from scratch on both servers): {same}/{total} "
                     f"identical" + (f", differing on {', '.join(unequal)}" if unequal else "")
                     + "; at C = 1, measured differences on documents whose control was identical: "
                     + (", ".join(left) if left else "none"))
    return lines


def twin_env(run: Mapping[str, Any], device: str, twin: str, own: str) -> dict[str, str]:
    """The environment the twin ran with and ``own``, the server it repeats, did not (``--twin-env``)."""
    slot = run["servers"][device]
    base = slot.get(own, {}).get("env", {})
    return {k: v for k, v in slot[twin].get("env", {}).items() if base.get(k) != v}


def twin_lines(run: Mapping[str, Any]) -> list[str]:
    """Per device and C with a twin: twin / the server it repeats. With the same environment that is the noise
    floor the targets' ratios sit on; with ``--twin-env``, that environment's effect in the same turns."""
    lines = []
    for device in run["device_order"]:
        twin = twin_key(run, device)
        if twin is None:
            continue
        own = twin_of(twin)
        assert own is not None  # twin_key answers twin keys only
        env = " ".join(f"{k}={v}" for k, v in twin_env(run, device, twin, own).items())
        what = f"with {env}" if env else f"noise floor (a second {own} server, interleaved)"
        for c in levels(run, device):
            r = ratio(run, device, c, mode=twin, base=own)
            if r is not None:
                lines.append(f"  - {device} C={c}, {what}: {twin} / {own} {r:.2f}, paired "
                             f"{paired_text(run, device, c, twin, own)}"
                             + (f"; outputs identical to off {_identical(run, device, c, 'identical_twin')}"
                                if twin == ON_TWIN else ""))
    return lines


def schedule_line(run: Mapping[str, Any]) -> str:
    if run.get("schedule", "sequential") == "sequential":
        return "Schedule: sequential (one server at a time, each serving all its rounds)."
    return ("Schedule: interleaved (a device's off and on servers up at once, serving each round in turn, the turns "
            "rotating; a server's write-back drained before its peer measures; every server --sleep-on-idle).")


def breakeven_line(run: Mapping[str, Any]) -> str:
    b = run.get("breakeven")
    if not b:
        return "No break-even device in this run."
    if b.get("error"):
        return f"Break-even device: not run ({b['error']})."
    how = ("given (--breakeven-mbps)" if b["source"] == "given" else
           f"derived: {b['prefix_bytes'] / 1e6:.1f} MB of KV per prefix / suffix compute {b['compute_s']:.3f} s "
           f"({b['basis']}, C={b['concurrency']})")
    return f"Break-even read rate {b['mbps']:.1f} MB/s, {how}; writes {b.get('write_mbps') or 'as reads'} MB/s."


def markdown(run: Mapping[str, Any]) -> str:
    s, w = run["sizing"], run["workload"]
    parts = [f"# bench_streaming: {run['started']}", "", *machine_paragraph(dict(run)),
             (f"Model `{run['model']['name']}` ({model_dtype(dict(run))}{run['model']['kv_bytes_per_token']} KV "
              f"bytes/token), {'GPU' if run['gpu'] else 'CPU'}, page {s['page_size']} tokens, device pool "
              f"{s['device_tokens']} tokens, host pool {s['host_tokens']} tokens; prefetch policy "
              f"{run['prefetch_policy']}; page cache: {run['page_cache']}."), "",
             f"Workload: {w['description']}", "", schedule_line(run), "", breakeven_line(run), "",
             ("`on/off`: the L3-hit TTFT with streaming on over the same with it off, same device and C (lower is "
              "better). `paired on/off`: the median over the measured requests of each one's on/off TTFT, the same "
              "request on both servers (interleaved schedule: the rounds alternate between them), and the range of "
              "the per-round p50 ratios. `identical outputs`: measured requests whose greedy output on the `on` "
              "server equals the `off` server's. Row `off-twin` / `on-twin` (`--twin`): a second server of that "
              "mode, its columns against `off` too; under the targets, twin / its mode: the noise floor, or with "
              "`--twin-env` that environment's effect. Counters are the phases' deltas of the server's `/metrics` "
              "(`-`: not exported)."), ""]
    for device in run["device_order"]:
        parts += [f"## {device}", "", run["devices"][device]["description"], "", table(run, device), ""]
        bind = bind_lines(run, device)
        parts += [*bind, ""] if bind else []
        phases = phase_table(run, device)
        parts += ["Where the TTFT went, p50 of each phase (SGLang's own request stamps: sent -> waiting queue; of "
                  "the wait, the L3 prefetch polls; the rest of the wait; batch formed -> result processed, "
                  "load-back and forward included; -> first token at the client):", "", phases, ""] if phases else []
        cpu = thread_table(run, device)
        parts += ["Where the CPU went: CPU ms per measured L3 request, by thread (the server's processes during the "
                  "measured rounds; `kvtier-*`: sgl-kvtier's named threads; a process's name: its other threads, "
                  "the forward and its OpenMP team among them):", "", cpu, ""] if cpu else []
    parts += ["## References (device hit, recompute)", "", reference_table(run), "",
              "## Targets", "", *targets(run), "", "## Server commands", ""]
    for device in run["device_order"]:
        for mode, res in run["servers"].get(device, {}).items():
            env = " ".join(f"{k}={v}" for k, v in res.get("env", {}).items())
            logs = res.get("log_counts", {})
            parts += [f"- **{device} / streaming {mode}**, started in {res.get('startup_s') or 0:.0f} s, "
                      f"{logs.get('sgl_kvtier_tracebacks', '?')} sgl_kvtier tracebacks"
                      + (f", FAILED: {res['error'][:300]}" if res.get("error") else "") + ":",
                      f"  `{env + ' ' if env else ''}{res.get('command_str', '')}`"]
    return "\n".join(parts) + "\n"
