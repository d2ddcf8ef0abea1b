"""TTFT and throughput of SGLang with five prefix-cache configurations, side by side, in one run.

(a) recompute (--disable-radix-cache), (b) radix (device only), (c) hicache-dram (device + host DRAM),
(d) file-l3 (HiCache + SGLang's `file` L3), (e) kvtier-l3 (HiCache + sgl-kvtier L3): same model, same
workload, same machine. Each configuration gets its own real `sglang.launch_server` (own process group,
SIGTERM to stop), which then serves every workload at every concurrency level; each level uses fresh
prompts (a different token salt), so it starts cold in every tier.

    python -m benchmarks.bench_serving --model bench --configs a b c d e --concurrency 4 8
    python -m benchmarks.bench_serving --help

Writes <out>/results.json (every request, every /metrics delta, the exact server commands),
<out>/report.md and <out>/ttft_vs_concurrency.png, <out>/hit_tokens_by_tier.png. See docs/benchmarks/serving.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import TRACE, page_cache_policy, progress
from benchmarks.serving import configs, report, session, workloads
from benchmarks.serving.models import run_model
from benchmarks.serving.probes import prebuild_hash_extension, scheduler_pid, store_summary
from sgl_kvtier.serving import summary
from sgl_kvtier.serving.hardware import AUTO, DTYPE_BYTES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="bench", help="tiny | bench | kvheavy (random models made offline) or a model path")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *sorted(DTYPE_BYTES)],
                   help="model and KV dtype; auto: KVTIER_MODEL_DTYPE, else bfloat16 on a GPU or a CPU with "
                        "AVX512-BF16/AMX, else float32 (a model path on a GPU: its config.json's)")
    p.add_argument("--configs", nargs="+", default=["a", "b", "c", "d", "e"],
                   help="subset of a-e or recompute radix hicache-dram file-l3 kvtier-l3")
    p.add_argument("--workload", nargs="+", default=["multiturn"], choices=["multiturn", "trace", "docqa"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8, 16])
    p.add_argument("--out", type=Path, help="default benchmarks/results/serving-<timestamp>/")
    session.add_device_args(p)
    session.add_multiturn_args(p, clients=16, rounds=4, system_tokens=512, user_tokens=256, answer_tokens=64)
    g = p.add_argument_group("docqa")
    g.add_argument("--documents", type=int, default=4)
    g.add_argument("--doc-tokens", type=int, default=3000)
    g.add_argument("--questions", type=int, default=5)
    g.add_argument("--question-tokens", type=int, default=64)
    g = p.add_argument_group("trace")
    g.add_argument("--trace", type=Path, default=TRACE)
    g.add_argument("--trace-requests", type=int, default=40)
    g.add_argument("--trace-block-tokens", type=int, default=32, help="tokens per 512-token trace block")
    g.add_argument("--trace-max-tokens", type=int, default=3072)
    g.add_argument("--trace-time-scale", type=float, default=0.0,
                   help="seconds per trace second; 0 = closed loop (next request as soon as a slot frees)")
    g.add_argument("--trace-warmup-fraction", type=float, default=0.5)
    g = p.add_argument_group("server")
    g.add_argument("--max-new-tokens", type=int, default=8)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--device-tokens", type=int, help="--max-total-tokens; default: --device-factor x longest request")
    g.add_argument("--device-factor", type=float, default=1.25)
    g.add_argument("--host-ratio", type=float,
                   help="--hicache-ratio of the HiCache configs; default: 2, or enough for max concurrency x the "
                        "longest request (the host pool stages L3 loads)")
    g.add_argument("--hicache-size", type=int, default=0, help="--hicache-size GB (overrides --host-ratio)")
    g.add_argument("--hicache-io-backend")
    g.add_argument("--hicache-mem-layout")
    g.add_argument("--server-arg", action="append", default=[], help="extra launch_server argument (repeatable)")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    g = p.add_argument_group("L3 and measurement")
    g.add_argument("--l3-dir", type=Path, help="where the L3 stores go (default <out>/l3); put it on the flash to measure")
    g.add_argument("--kvtier-capacity-gb", type=float, default=8.0)
    g.add_argument("--kvtier-extra", type=json.loads, default={},
                   help='more keys for kvtier-l3\'s extra config, e.g. \'{"io_depth": 4, "io_engine": "uring"}\'')
    g.add_argument("--keep-l3", action="store_true", help="keep the L3 directories after each configuration")
    g.add_argument("--flush-between-phases", action="store_true",
                   help="POST /flush_cache before each measured phase (deterministic smoke mode, not real spill)")
    g.add_argument("--no-drop-caches", action="store_true", help="do not drop the OS page cache between phases")
    g.add_argument("--backup-wait", type=float, default=60.0, help="max seconds to wait for L3 write-back per phase")
    g.add_argument("--repeat", type=int, default=1,
                   help="run the configuration list this many times in a row (a..e, a..e): spreads other load on a "
                        "shared machine over all configurations; tables pool the requests of all repetitions")
    g.add_argument("--py-spy", action="store_true", help="record the scheduler of each config with py-spy (SVG)")
    g.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.configs = configs.resolve(args.configs)
    return args


def build_workload(args: argparse.Namespace, name: str, salt: int, lo_hi: tuple[int, int],
                   rows: list[dict[str, Any]] | None) -> workloads.Workload:
    src = workloads.TokenSource(*lo_hi, salt=salt)
    if name == "multiturn":
        return workloads.multiturn(src, clients=args.clients, rounds=args.rounds, system_tokens=args.system_tokens,
                                   user_tokens=args.user_tokens, answer_tokens=args.answer_tokens,
                                   max_new_tokens=args.max_new_tokens)
    if name == "docqa":
        return workloads.docqa(src, documents=args.documents, doc_tokens=args.doc_tokens, questions=args.questions,
                               question_tokens=args.question_tokens, max_new_tokens=args.max_new_tokens)
    return workloads.trace(src, rows or [], requests=args.trace_requests, block_tokens=args.trace_block_tokens,
                           max_tokens=args.trace_max_tokens, max_new_tokens=args.max_new_tokens,
                           time_scale=args.trace_time_scale, warmup_fraction=args.trace_warmup_fraction)


def run_config(args, cfg, plan, model_dir, wls, drop, kvbpt, bars, task, console, rep: int = 0) -> dict[str, Any]:
    from sgl_kvtier.serving.server import SGLangServer

    l3 = cfg.l3_dir(plan)
    if cfg.l3:
        shutil.rmtree(l3, ignore_errors=True)
        l3.mkdir(parents=True, mode=0o700)
    tag = cfg.name if args.repeat == 1 else f"{cfg.name}-r{rep + 1}"
    srv = SGLangServer(model_dir, extra_args=cfg.args(plan), log_path=args.out / "logs" / f"{tag}.log",
                       cpu=not plan.gpu, startup_timeout_s=args.startup_timeout)
    res: dict[str, Any] = {
        "key": cfg.key, "summary": cfg.summary, "command": srv.command, "command_str": shlex.join(srv.command),
        "env": {k: v for k, v in srv.env.items() if os.environ.get(k) != v}, "log": str(srv.log_path),
        "workloads": {},
    }
    bars.update(task, description=f"{cfg.name}: starting server")
    srv.start()
    res["startup_s"], res["gc_frozen"] = srv.startup_s, srv.gc_frozen
    spy = None
    if args.py_spy and (pid := scheduler_pid(srv.proc.pid)):
        spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid), "--rate", "50",
                                "--output", str(args.out / f"profile-{tag}.svg"), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        session.serve_levels(args, srv, wls, plan.page_size, label=cfg.name, l3=bool(cfg.l3), flush=cfg.key != "a",
                             drop=drop, kvbpt=kvbpt, bars=bars, task=task, console=console, rep=rep,
                             into=res["workloads"])
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
        res["exit_code"] = srv.stop()
        res["l3_store"] = store_summary(cfg, l3) if cfg.l3 else {}
        if cfg.l3 and not args.keep_l3:
            shutil.rmtree(l3, ignore_errors=True)
    return res


def merge(run: dict[str, Any], cfg: configs.Config, res: dict[str, Any], kvbpt: int) -> None:
    """Add one repetition's result to run["configs"][name]; levels pool the phases of all repetitions."""
    entry = run["configs"].setdefault(cfg.name, {"key": cfg.key, "summary": cfg.summary, "runs": [], "workloads": {}})
    for key in ("command", "command_str", "env", "startup_s"):
        if key in res:
            entry.setdefault(key, res[key])
    entry["runs"].append({k: v for k, v in res.items() if k not in ("workloads", "key", "summary", "command", "env")})
    for wl, levels in res.get("workloads", {}).items():
        pooled = entry["workloads"].setdefault(wl, [])
        for level in levels:
            cell = next((c for c in pooled if c["concurrency"] == level["concurrency"]), None)
            if cell is None:
                cell = {"concurrency": level["concurrency"], "salt": level["salt"], "phases": [], "p50_by_repeat": []}
                pooled.append(cell)
            cell["phases"] += level["phases"]
            cell["p50_by_repeat"].append(level["summary"]["ttft_p50_s"])
            cell["summary"] = summary.summarize(cell["phases"], kvbpt) | {"ttft_p50_by_repeat": cell["p50_by_repeat"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console, started = session.start(args, "serving")
    served = run_model(args.model, args.dtype, args.gpu, args.server_arg)
    model, server_args = served.model, list(served.server_args)
    model_dir, model_name = model.path, model.name
    dtype, dtype_source, kvbpt = served.dtype, served.dtype_source, served.kv_bytes_per_token
    rows = workloads.load_trace(args.trace) if "trace" in args.workload else None
    lo_hi = workloads.token_range(model_dir)
    wls = {(w, li, c): build_workload(args, w, 1000 * wi + li, lo_hi, rows)
           for wi, w in enumerate(args.workload) for li, c in enumerate(args.concurrency)}
    max_ctx = max(wl.max_context() for wl in wls.values())
    device = args.device_tokens or configs.size_device_pool(max_ctx, args.page_size, args.device_factor)
    ratio = args.host_ratio or configs.host_ratio_for(device, max(args.concurrency) * max_ctx)
    plan = configs.ServerPlan(page_size=args.page_size, device_tokens=device, host_ratio=ratio,
                              host_size_gb=args.hicache_size, gpu=args.gpu, l3_root=(args.l3_dir or args.out / "l3").resolve(),
                              kvtier_capacity_bytes=int(args.kvtier_capacity_gb * 1e9),
                              hicache_io_backend=args.hicache_io_backend, hicache_mem_layout=args.hicache_mem_layout,
                              extra_args=tuple(server_args), kvtier_extra=args.kvtier_extra)
    host = plan.host_tokens(kvbpt)
    drop, policy = page_cache_policy(args.no_drop_caches)
    info = {w: wls[(w, 0, args.concurrency[0])].summary(args.page_size) for w in args.workload}
    console.print(f"[bold]bench_serving[/] model={model_name} {dtype} ({dtype_source}; {kvbpt} KV bytes/token) "
                  f"{'GPU' if args.gpu else 'CPU'}; "
                  f"device pool {device} tokens, host pool {host} tokens -> capacity {device + host} tokens "
                  f"({(device + host) * kvbpt / 1e9:.2f} GB); page cache {policy}")
    for w, i in info.items():
        uniq = i["unique_prefix_tokens_cumulative"][-1]
        console.print(f"  {w}: {i['description']}; longest request {i['max_context_tokens']} tokens; unique prefix "
                      f"tokens per level {uniq} ({uniq * kvbpt / 1e9:.2f} GB) = {uniq / (device + host):.1f}x device+host, "
                      f"{uniq / max(device, host):.1f}x the larger pool (write-through keeps device KV in the host "
                      "pool too)" + ("" if uniq > max(device, host) else "  [yellow](fits: no spill to L3)[/]"))
    staging = max(args.concurrency) * max_ctx
    if any(c.l3 for c in args.configs) and host < staging:
        console.print(f"  [yellow]host pool {host} < max concurrency x longest request = {staging} tokens: L3 loads "
                      "are staged in the host pool, and queued requests' prefetched pages may be evicted before "
                      "they are used (raise --host-ratio)[/]")
    run: dict[str, Any] = {
        "started": started, "argv": sys.argv if argv is None else argv, "gpu": args.gpu,
        "model": served.record(),
        "machine": session.machine(model, server_args),
        "page_cache": {"dropped": drop, "policy": policy, "flush_between_phases": args.flush_between_phases},
        "sizing": {"page_size": args.page_size, "device_tokens": device, "host_tokens": host,
                   "host_ratio": ratio, "hicache_size_gb": args.hicache_size, "max_context_tokens": max_ctx},
        "workloads": list(args.workload), "workload_info": info, "concurrency": args.concurrency,
        "config_order": [c.name for c in args.configs], "configs": {},
    }  # fmt: skip
    if any(c.l3 for c in args.configs) and not args.gpu:
        run["hash_extension"] = prebuild_hash_extension()
    total = args.repeat * len(args.configs) * sum(len(wl.requests) for wl in wls.values())
    failed = 0
    try:
        with progress(console, disable=args.no_progress) as bars:
            task = bars.add_task("starting", total=total)
            for rep in range(args.repeat):
                for cfg in args.configs:
                    try:
                        res = run_config(args, cfg, plan, model_dir, wls, drop, kvbpt, bars, task, console, rep)
                        merge(run, cfg, res | {"repeat": rep}, kvbpt)
                    except Exception as exc:  # noqa: BLE001 - one broken configuration must not lose the others
                        failed += 1
                        entry = run["configs"].setdefault(cfg.name, {"key": cfg.key, "summary": cfg.summary,
                                                                     "command_str": shlex.join(cfg.args(plan)),
                                                                     "runs": [], "workloads": {}})
                        entry["error"] = session.failure(console, cfg.name, exc)
                    session.save(run, args.out)
    finally:
        session.finish(run, args.out, report.markdown, report.plots, console)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
