"""L3-hit TTFT with the tail of each hit streamed in layer groups (``streaming = "on"``) vs the hit loaded
whole before admission (``streaming = "off"``), on real SGLang servers, on a fast and a break-even device.

Each (device setting, streaming mode) pair gets its own real ``sglang.launch_server`` (HiCache + sgl-kvtier L3,
a fresh L3 directory, ``streaming`` set in the L3 config) serving the same prompts: a write round puts D
document prefixes in L3, then every later round waits for the L3 write-back, flushes L1 + L2 and drops the
page cache, and asks one new question per document, so each prefix is in L3 only when its request arrives
(bench_policy's rounds). A device's ``off`` and ``on`` servers are up at once and take turns round by round
(``--schedule interleaved``, ``streaming.servers``), so each measured round is a paired on/off comparison
(``streaming.paired``); ``--twin`` adds a second ``off`` server to each device's turns, whose ratio to the
first is the noise floor of those comparisons (``--twin on --twin-env K=V``: a second ``on`` server with
more environment, measured against the first in the same turns). The first server also measures the
references: device (L1/L2) hits and recompute. Its device-hit TTFT is the suffix's compute time, from which
the break-even device's read rate is derived (prefix KV bytes / compute seconds) before the break-even
servers start. See docs/benchmarks/streaming.md.

    python -m benchmarks.bench_streaming                    # kvheavy, fast + breakeven, C = 1 2 4, off vs on
    python -m benchmarks.bench_streaming --smoke            # tiny model, 1 document, 2 requests per server
    python -m benchmarks.bench_streaming --help

Writes <out>/results.json (every request with its output, /metrics deltas, the exact server commands and
environment), <out>/report.md and <out>/ttft_streaming.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import files_bytes, page_cache_policy, progress
from benchmarks.machine import memory_available_bytes
from benchmarks.serving import configs, session, workloads
from benchmarks.serving.models import run_model
from benchmarks.serving.policies import DeviceSetting
from benchmarks.serving.probes import prebuild_hash_extension
from benchmarks.streaming import outputs, paired, plan, plot, rounds, servers
from benchmarks.streaming import report as stream_report
from sgl_kvtier.serving.hardware import AUTO, DTYPE_BYTES

PREFETCH_POLICIES = ("timeout", "wait_complete", "best_effort")
SMOKE = {"model": "tiny", "devices": ["fast"], "concurrency": [1], "documents": 1, "doc_tokens": 512,
         "question_tokens": 32, "rounds": 2, "prime_rounds": 0, "reference_rounds": 1, "backup_wait": 120.0,
         "kvtier_capacity_gb": 0.25}  # L3 under one 1 GiB segment (small CI disks)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help=f"tiny model, 1 document, 2 measured requests per server (explicit flags still win): {SMOKE}")
    p.add_argument("--model", default="kvheavy", help="tiny | bench | kvheavy (random models made offline) or a path")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *sorted(DTYPE_BYTES)],
                   help="model and KV dtype; auto: KVTIER_MODEL_DTYPE, else bfloat16 on a GPU or a CPU with "
                        "AVX512-BF16/AMX, else float32")
    p.add_argument("--devices", nargs="+", default=["fast", plan.BREAKEVEN],
                   help="device settings: 'fast', 'breakeven' (reads throttled to prefix bytes / suffix compute "
                        "time) or 'slow:READ_MBPS[:WRITE_MBPS]'")
    p.add_argument("--streaming", nargs="+", default=[m.value for m in plan.MODES],
                   help="modes: off (hits loaded whole) and on (tails streamed)")
    p.add_argument("--twin", nargs="?", const=plan.Streaming.OFF.value, choices=[m.value for m in plan.MODES],
                   help="a second server of this mode (default off) per device, interleaved with the others: "
                        "off-twin / off is the run's noise floor; with --twin-env, twin / its mode measures that "
                        "environment")
    p.add_argument("--twin-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the twin alone, over --server-env (repeatable; needs --twin)")
    p.add_argument("--breakeven-mbps", type=float, help="the break-even read rate (default: derived in the run)")
    p.add_argument("--breakeven-write-mbps", type=float, default=1000.0,
                   help="write cap of the break-even device (the write-back is not what is measured)")
    p.add_argument("--slow-latency-ms", type=float, default=2.0, help="latency added per IO on throttled devices")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--schedule", type=servers.Schedule, default=servers.Schedule.INTERLEAVED,
                   choices=list(servers.Schedule),
                   help="interleaved: a device's off and on servers up at once, rounds alternating between them; "
                        "sequential: one server at a time")
    p.add_argument("--out", type=Path, help="default benchmarks/results/streaming-<timestamp>/")
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--gpu", dest="gpu", action="store_true", default=None, help="GPU flags (default: auto-detect)")
    dev.add_argument("--cpu", dest="gpu", action="store_false", help="CPU route even if a GPU is present")
    g = p.add_argument_group("workload")
    g.add_argument("--documents", type=int, default=8, help="documents (requests per round)")
    g.add_argument("--doc-tokens", type=int, default=1536, help="tokens of each document: the prefix in L3")
    g.add_argument("--question-tokens", type=int, default=64, help="the suffix every request computes")
    g.add_argument("--rounds", type=int, default=2, help="measured L3 rounds per concurrency level")
    g.add_argument("--prime-rounds", type=int, default=1, help="unmeasured L3 rounds after the write round")
    g.add_argument("--reference-rounds", type=int, default=1, help="device-hit and recompute rounds per level")
    g.add_argument("--no-references", action="store_true", help="skip the device-hit and recompute rounds")
    g.add_argument("--max-new-tokens", type=int, default=8, help="greedy tokens per request (compared on/off)")
    g = p.add_argument_group("server")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--device-tokens", type=int, help="--max-total-tokens; default 1.25x max C x the longest request")
    g.add_argument("--host-ratio", type=float,
                   help="--hicache-ratio; default: room for (documents + 2 x max C) x the longest request")
    g.add_argument("--prefetch-policy", default="timeout", choices=PREFETCH_POLICIES,
                   help="--hicache-storage-prefetch-policy of every server (SGLang's default: timeout)")
    g.add_argument("--kvtier-capacity-gb", type=float, default=8.0)
    g.add_argument("--kvtier-extra", type=json.loads, default={},
                   help='more keys for every server\'s sgl-kvtier extra config (streaming is set per server)')
    g.add_argument("--server-arg", action="append", default=[], help="extra launch_server argument (repeatable)")
    g.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of every server (repeatable; KVTIER_PREFETCH_POLICY=off unless given)")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    g = p.add_argument_group("measurement")
    g.add_argument("--l3-dir", type=Path, help="where the L3 stores go (default <out>/l3)")
    g.add_argument("--keep-l3", action="store_true", help="keep each server's L3 directory")
    g.add_argument("--no-drop-caches", action="store_true", help="do not drop the OS page cache between rounds")
    g.add_argument("--backup-wait", type=float, default=600.0, help="max seconds to wait for L3 write-back")
    g.add_argument("--backup-stall", type=float, default=60.0,
                   help="stop waiting for write-back once the backed-up token count has not moved for this long")
    g.add_argument("--no-progress", action="store_true")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    args.modes = plan.parse_modes(args.streaming)
    args.env = {"KVTIER_PREFETCH_POLICY": "off", **env_pairs(p, "--server-env", args.server_env)}
    if args.twin_env and args.twin is None:
        p.error("--twin-env sets the twin's environment: it needs --twin")
    args.twin_env = env_pairs(p, "--twin-env", args.twin_env)
    try:
        args.server_runs = plan.plan_servers(args.devices, args.modes, not args.no_references,
                                             args.breakeven_mbps is not None,
                                             None if args.twin is None else plan.Streaming(args.twin))
    except ValueError as exc:
        p.error(str(exc))
    return args


def env_pairs(p: argparse.ArgumentParser, flag: str, values: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict; a value without ``=`` is a usage error naming ``flag``."""
    bad = [v for v in values if "=" not in v or not v.split("=", 1)[0]]
    if bad:
        p.error(f"{flag} takes KEY=VALUE, got {bad[0]!r}")
    return dict(v.split("=", 1) for v in values)


def derive_breakeven(args: argparse.Namespace, ref: dict[str, Any] | None, nbytes: int) -> dict[str, Any]:
    """The break-even device's record: the rate given, or derived from the reference server's device hits at
    its lowest concurrency (``plan.suffix_compute_s``); ``error`` when it cannot be known."""
    out: dict[str, Any] = {"prefix_bytes": nbytes, "write_mbps": args.breakeven_write_mbps}
    if args.breakeven_mbps is not None:
        return out | {"source": "given", "mbps": args.breakeven_mbps}
    phases = [r for r in (ref or {}).get("rounds", []) if r["kind"] == rounds.DEVICE]
    if not phases:
        return out | {"error": "the reference server measured no device hit"}
    c = min(r["concurrency"] for r in phases)
    try:
        compute_s, basis = plan.suffix_compute_s([q for r in phases if r["concurrency"] == c for q in r["requests"]])
    except ValueError as exc:
        return out | {"error": str(exc)}
    return out | {"source": "measured", "compute_s": compute_s, "basis": basis, "concurrency": c,
                  "mbps": plan.breakeven_mbps(nbytes, compute_s)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console, started = session.start(args, "streaming")
    served = run_model(args.model, args.dtype, args.gpu, args.server_arg)
    model, server_args, kvbpt = served.model, list(served.server_args), served.kv_bytes_per_token
    src = workloads.TokenSource(*workloads.token_range(model.path), salt=0)
    shape = {"documents": args.documents, "doc_tokens": args.doc_tokens, "question_tokens": args.question_tokens,
             "concurrency": args.concurrency, "rounds": args.rounds, "prime_rounds": args.prime_rounds,
             "max_new_tokens": args.max_new_tokens, "reference_rounds": args.reference_rounds}
    by_refs = {r: rounds.streaming_rounds(src, **shape, references=r) for r in (False, True)}
    longest = max(len(q.tokens) + q.max_new_tokens for rnd in by_refs[True] for q in rnd.requests)
    top = max(args.concurrency)
    device_tokens = args.device_tokens or configs.size_device_pool(top * longest, args.page_size, 1.25)
    ratio = args.host_ratio or configs.host_ratio_for(device_tokens, (args.documents + 2 * top) * longest)
    base_plan = configs.ServerPlan(page_size=args.page_size, device_tokens=device_tokens, host_ratio=ratio,
                                   host_size_gb=0, gpu=args.gpu, l3_root=(args.l3_dir or args.out / "l3").resolve(),
                                   kvtier_capacity_bytes=int(args.kvtier_capacity_gb * 1e9),
                                   extra_args=tuple(server_args))
    drop, cache_policy = page_cache_policy(args.no_drop_caches)
    up = len(args.modes) + (args.twin is not None) if args.schedule is servers.Schedule.INTERLEAVED else 1
    pools = (base_plan.host_tokens(kvbpt) + (0 if args.gpu else device_tokens)) * kvbpt  # a GPU's pool is its own
    short = plan.memory_short(up, pools, files_bytes(model.path), memory_available_bytes())
    nbytes = plan.prefix_bytes(args.doc_tokens, args.page_size, kvbpt)
    description = (f"{args.documents} documents x {args.doc_tokens} tokens ({nbytes / 1e6:.1f} MB of KV each) + "
                   f"{args.question_tokens}-token questions; 1 write round, {args.prime_rounds} prime round(s), "
                   f"{args.rounds} measured L3 round(s) per C in {args.concurrency}; {args.max_new_tokens} new "
                   f"tokens; references: " + ("none" if args.no_references else
                                              f"{args.reference_rounds} device-hit and recompute round(s) per C"))
    console.print(f"[bold]bench_streaming[/] model={model.name} {served.dtype} ({served.dtype_source}; {kvbpt} KV "
                  f"bytes/token) {'GPU' if args.gpu else 'CPU'}; {description}; device pool {device_tokens}, host "
                  f"pool {base_plan.host_tokens(kvbpt)} tokens; page cache {cache_policy}")
    if short:
        console.print(f"[bold red]WARNING: {short}[/]")
    console.print("Targets:\n" + "\n".join(f"  {t.words}" for t in stream_report.TARGETS)
                  + "\n  outputs identical on/off")
    run: dict[str, Any] = {
        "started": started, "argv": sys.argv if argv is None else argv, "gpu": args.gpu,
        "args": {k: v for k, v in vars(args).items() if k not in ("modes", "server_runs")},
        "model": served.record(), "machine": session.machine(model, server_args), "page_cache": cache_policy,
        "prefetch_policy": args.prefetch_policy, "schedule": args.schedule.value,
        "sizing": {"page_size": args.page_size, "device_tokens": device_tokens,
                   "host_tokens": base_plan.host_tokens(kvbpt), "host_ratio": ratio, "longest_request_tokens": longest},
        "workload": {"description": description, **shape},
        "modes": [m.value for m in args.modes], "devices": {}, "device_order": [], "servers": {}, "identical": {},
        "breakeven": None, "references": None,
    }  # fmt: skip
    if not args.gpu:
        run["hash_extension"] = prebuild_hash_extension()
    total = sum(len(q.requests) for s in args.server_runs for q in by_refs[s.references])
    breakeven: DeviceSetting | None = None
    failed = 0
    try:
        with progress(console, disable=args.no_progress) as bars:
            task = bars.add_task("starting", total=total)
            for spec_device, group in itertools.groupby(args.server_runs, key=lambda r: r.device):
                if spec_device == plan.BREAKEVEN and breakeven is None:
                    ref = next((r for d in run["servers"].values() for r in d.values() if r.get("references")), None)
                    derived = run["breakeven"] = derive_breakeven(args, ref, nbytes)
                    if "error" in derived:
                        console.print(f"[red]break-even device skipped: {derived['error']}[/]")
                        failed += 1
                        continue
                    breakeven = plan.breakeven_device(derived["mbps"], args.breakeven_write_mbps, args.slow_latency_ms)
                    console.print(f"[bold]{stream_report.breakeven_line(run)}[/]")
                device = plan.resolve_device(spec_device, args.slow_latency_ms, breakeven)
                run["devices"][device.name] = {"spec": spec_device, "description": device.describe(),
                                               "throttle": device.throttle}
                run["device_order"].append(device.name)
                slot = run["servers"].setdefault(device.name, {})
                made = [servers.BenchServer(args, spec, device, base_plan, model.path, by_refs[spec.references],
                                            drop, kvbpt) for spec in group]
                for batch in servers.batches(args.schedule, made):
                    servers.run_batch(batch, console, bars, task)
                    for s in batch:
                        slot[s.spec.key] = s.res
                        failed += s.failed
                        if s.spec.references:
                            run["references"] = {"device": device.name, "streaming": s.spec.streaming.value}
                    session.save(run, args.out)
                if {"off", "on"} <= slot.keys():
                    run["identical"][device.name] = outputs.compare(slot["off"], slot["on"])
                    run.setdefault("identical_control", {})[device.name] = outputs.compare(
                        slot["off"], slot["on"], outputs.CONTROL)
                if {"off", plan.ON_TWIN} <= slot.keys():  # a streaming twin's outputs are checked alike
                    run.setdefault("identical_twin", {})[device.name] = outputs.compare(slot["off"], slot[plan.ON_TWIN])
                for (base, key), record in plan.PAIRED_RECORDS.items():
                    if {base, key} <= slot.keys():
                        run.setdefault(record, {})[device.name] = paired.compare(slot[base], slot[key])
                session.save(run, args.out)
    finally:
        session.finish(run, args.out, stream_report.markdown, plot.plot, console)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
