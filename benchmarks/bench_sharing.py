"""Two SGLang instances behind SGLang's router (round-robin): per-instance vs shared L3, in one run.

Four configurations (``benchmarks.serving.sharing``): ``radix`` (no L3), ``kvtier-per-instance`` (a kvtier
store each), ``file-shared`` (SGLang's ``file`` backend, one directory for both) and ``kvtier-shared`` (one
kvtier store for both). Each starts two real ``sglang.launch_server`` instances (own process groups, one
CPU each by default) and ``sglang_router.launch_router --policy round_robin`` in front, then plays a
multi-turn chat through the router: with an odd number of conversations, round-robin sends each
conversation's consecutive turns to alternate instances, so turn r finds turn r-1's KV only in a shared L3.
Every request's instance is read back from the instances' request logs.

    python -m benchmarks.bench_sharing                       # defaults: about 10-15 minutes on 2 CPU cores
    python -m benchmarks.bench_sharing --configs radix per-instance file --clients 3 --rounds 3   # a smoke run
    python -m benchmarks.bench_sharing --help

Writes <out>/results.json (every request with its instance, every server and router command, the machine),
<out>/report.md (table, targets) and <out>/sharing.png. See docs/benchmarks/sharing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import args_json, drop_caches, page_cache_policy, progress
from benchmarks.serving import configs, session, sharing, sharing_report, workloads
from benchmarks.serving.models import run_model
from benchmarks.serving.probes import cpu_seconds, prebuild_hash_extension, store_summary
from benchmarks.serving.router import Frontend, RouterProcess, run_phase
from sgl_kvtier.serving import client
from sgl_kvtier.serving.hardware import AUTO, DTYPE_BYTES

INSTANCES = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="bench", help="tiny | bench | kvheavy (random models made offline) or a model path")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *sorted(DTYPE_BYTES)],
                   help="model and KV dtype (see docs/benchmarks/index.md, Dtype)")
    p.add_argument("--configs", nargs="+", default=list(sharing.DEFAULT),
                   help=f"subset of {list(sharing.CONFIGS)} (aliases: {sorted(sharing.ALIASES)})")
    p.add_argument("--out", type=Path, help="default benchmarks/results/sharing-<timestamp>/")
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--gpu", dest="gpu", action="store_true", default=None, help="GPU flags (default: auto-detect)")
    dev.add_argument("--cpu", dest="gpu", action="store_false", help="CPU route even if a GPU is present")
    g = p.add_argument_group("multiturn (turns alternate between the instances)")
    g.add_argument("--clients", type=int, default=9, help="conversations; odd, so round-robin alternates each one's turns")
    g.add_argument("--rounds", type=int, default=4, help="turns per conversation; round 1 is the warm-up")
    g.add_argument("--system-tokens", type=int, default=256)
    g.add_argument("--user-tokens", type=int, default=512)
    g.add_argument("--answer-tokens", type=int, default=64)
    g.add_argument("--max-new-tokens", type=int, default=8)
    g.add_argument("--concurrency", type=int, default=4, help="requests in flight at the front (both instances)")
    g.add_argument("--salt", type=int, default=0, help="token salt of the prompts")
    g = p.add_argument_group("front")
    g.add_argument("--frontend", choices=["router", "client"], default="router",
                   help="SGLang's router, or a round-robin client (also the fallback when the router cannot start)")
    g.add_argument("--dispatch-gap-ms", type=float, default=50.0,
                   help="least time between two sends, so requests reach the router in order")
    g = p.add_argument_group("servers (each instance the same)")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--device-tokens", type=int, help="--max-total-tokens; default: --device-factor x longest request")
    g.add_argument("--device-factor", type=float, default=1.25)
    g.add_argument("--host-ratio", type=float, help="--hicache-ratio; default 2, or enough to stage an instance's "
                   "share of --concurrency x the longest request")
    g.add_argument("--hicache-size", type=int, default=0, help="--hicache-size GB (overrides --host-ratio)")
    g.add_argument("--hicache-io-backend")
    g.add_argument("--hicache-mem-layout")
    g.add_argument("--cores-per-server", type=int, default=1,
                   help="CPUs each instance is pinned to (taskset, OMP_NUM_THREADS); 0 = no pinning")
    g.add_argument("--server-arg", action="append", default=[], help="extra launch_server argument (repeatable)")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    g = p.add_argument_group("L3 and measurement")
    g.add_argument("--l3-dir", type=Path, help="where the L3 stores go (default <out>/l3)")
    g.add_argument("--kvtier-capacity-gb", type=float, default=8.0)
    g.add_argument("--kvtier-extra", type=json.loads, default={}, help="more keys for both kvtier configs' extra config")
    g.add_argument("--keep-l3", action="store_true", help="keep the L3 directories after each configuration")
    g.add_argument("--no-drop-caches", action="store_true", help="do not drop the OS page cache between rounds")
    g.add_argument("--backup-wait", type=float, default=60.0, help="max seconds to wait for each instance's L3 write-back")
    g.add_argument("--settle-s", type=float, default=1.0, help="extra wait after write-back in the shared configs")
    g.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        args.configs = sharing.resolve(args.configs)
    except ValueError as exc:
        p.error(str(exc))
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (round 1 is the warm-up)")
    if not sharing.alternates(args.clients, INSTANCES):
        p.error(f"--clients must not be a multiple of {INSTANCES}: round-robin would keep each conversation on one instance")
    return args


def _parallel(calls: list[Callable[[], Any]]) -> list[BaseException | None]:
    """Run ``calls`` in threads; the exception of each (None when it returned)."""
    errors: list[BaseException | None] = [None] * len(calls)

    def wrap(i: int) -> None:
        try:
            calls[i]()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            errors[i] = exc

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def snapshot(url: str) -> dict[str, float]:
    """An instance's counters (bench_serving's) and its request count."""
    samples = client.scrape(url)
    return client.counters(samples) | {"requests": sum(v for n, _, v in samples if n == "sglang:num_requests_total")}


def make_servers(args: argparse.Namespace, cfg: sharing.SharingConfig, plan: configs.ServerPlan, model_dir: Path,
                 pins: list[list[int]]) -> tuple[list[Any], list[Path]]:
    from sgl_kvtier.serving.server import SGLangServer

    servers, logs = [], []
    for i in range(INSTANCES):
        req_log = args.out / "logs" / f"{cfg.name}-w{i}-requests"
        shutil.rmtree(req_log, ignore_errors=True)
        env = {"OMP_NUM_THREADS": str(len(pins[i]))} if pins[i] else None
        srv = SGLangServer(model_dir, extra_args=cfg.args(plan, i, req_log), env=env, cpu=not plan.gpu,
                           log_path=args.out / "logs" / f"{cfg.name}-w{i}.log", startup_timeout_s=args.startup_timeout)
        srv.command = sharing.pinned_command(srv.command, pins[i])
        servers.append(srv)
        logs.append(req_log)
    return servers, logs


def open_front(args: argparse.Namespace, cfg: sharing.SharingConfig, urls: list[str]) -> Frontend:
    """The router in front of ``urls``, or the round-robin client with the reason the router is not used."""
    if args.frontend == "client":
        return Frontend(urls, None, "--frontend client")
    from sgl_kvtier.serving.server import free_port

    router = RouterProcess(urls, free_port(), free_port(), args.out / "logs" / f"{cfg.name}-router.log")
    try:
        return Frontend(urls, router.start())
    except Exception as exc:  # noqa: BLE001 - the benchmark goes on with the client doing round-robin
        return Frontend(urls, None, f"router could not start: {type(exc).__name__}: {exc}"[:1000])


def measure(servers: list[Any], front: Frontend, phase: list[workloads.Request], args: argparse.Namespace,
            cfg: sharing.SharingConfig, on_done: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    before = [snapshot(s.url) for s in servers]
    cpu0 = [cpu_seconds(s.proc.pid) for s in servers]
    load0 = os.getloadavg()[0]
    recs, wall = run_phase(front, phase, args.concurrency, cfg.name, args.dispatch_gap_ms / 1000, on_done)
    cpu1 = [cpu_seconds(s.proc.pid) for s in servers]
    per = [client.delta(snapshot(s.url), b) for s, b in zip(servers, before)]
    total = {k: sum(d.get(k, 0.0) for d in per) for k in set().union(*per)}
    cpu = {"server_s": round(sum(b["server_s"] - a["server_s"] for a, b in zip(cpu0, cpu1)), 2),
           "per_instance_server_s": [round(b["server_s"] - a["server_s"], 2) for a, b in zip(cpu0, cpu1)],
           "machine_busy_s": round(cpu1[0]["machine_busy_s"] - cpu0[0]["machine_busy_s"], 2),
           "loadavg_1m": [load0, os.getloadavg()[0]]}
    return {"wall_s": wall, "cpu": cpu, "metrics_delta": total, "instances_delta": per, "requests": recs}


def run_config(args: argparse.Namespace, cfg: sharing.SharingConfig, plan: configs.ServerPlan, model_dir: Path,
               wl: workloads.Workload, pins: list[list[int]], drop: bool, kvbpt: int, entry: dict[str, Any],
               bars: Any, task: Any, console: Any) -> None:
    dirs, root = cfg.l3_dirs(plan, INSTANCES), plan.l3_root / cfg.name
    shutil.rmtree(root, ignore_errors=True)  # every configuration starts with empty stores
    for d in dirs:
        d.mkdir(parents=True, mode=0o700)
    servers, req_logs = make_servers(args, cfg, plan, model_dir, pins)
    entry["instances"] = [{"index": i, "command": s.command, "command_str": shlex.join(s.command), "cpus": pins[i],
                           "env": {k: v for k, v in s.env.items() if os.environ.get(k) != v}, "log": str(s.log_path),
                           "request_log": str(req_logs[i]), "l3_dir": str(cfg.l3_dir(plan, i) or "")}
                          for i, s in enumerate(servers)]
    front: Frontend | None = None
    try:
        bars.update(task, description=f"{cfg.name}: starting {INSTANCES} servers")
        errors = _parallel([s.start for s in servers])
        for inst, s in zip(entry["instances"], servers):
            inst["startup_s"] = s.startup_s
        if any(errors):
            raise next(e for e in errors if e is not None)
        bars.update(task, description=f"{cfg.name}: starting the router")
        front = open_front(args, cfg, [s.url for s in servers])
        entry["frontend"] = front.record()
        if front.reason and args.frontend == "router":
            console.print(f"[yellow]{cfg.name}: {front.reason}; round-robin from the client instead[/]")
        phases: list[dict[str, Any]] = []
        for pi, phase in enumerate(wl.phases):
            settle: dict[str, Any] = {}
            if cfg.l3:
                settle["backups"] = [client.wait_backups(s.url, 0, args.backup_wait) for s in servers]
                if cfg.shared and args.settle_s > 0:
                    time.sleep(args.settle_s)  # the other writer's journal, re-read by the reader
            if drop:
                settle["drop_caches_s"] = drop_caches()
            bars.update(task, description=f"{cfg.name}: round {pi + 1}{' (warm-up)' if pi == 0 else ''}")
            m = measure(servers, front, phase, args, cfg, lambda _r: bars.advance(task))
            phases.append({"phase": pi, "measured": pi > 0, "settle": settle, **m})
        sharing.attribute([r for p in phases for r in p["requests"]], [sharing.parse_request_log(d) for d in req_logs])
        entry["phases"] = phases
        entry["alternation"] = sharing.alternation(phases)
        entry["summary"] = sharing_report.summarize(phases, kvbpt)
        if front.router is not None:
            entry["router_worker_counts"] = front.router.worker_counts()
        s, alt = entry["summary"], entry["alternation"]
        console.log(f"{cfg.name:20s} TTFT p50 {s['ttft_p50_s']:.2f} s p99 {s['ttft_p99_s']:.2f} s, cached "
                    f"{s['cached_total']} (storage {s['cached_tokens']['storage']}) of {s['prompt_tokens']}, turns "
                    f"switched {alt['switched']}/{alt['transitions']}, per instance {alt['requests_per_worker']}, "
                    f"{s['errors']} errors")
    finally:
        if front is not None and front.router is not None:
            entry.setdefault("frontend", front.record())["router_exit_code"] = front.router.stop()
        _parallel([s.stop for s in servers])
        for inst, srv in zip(entry["instances"], servers):
            inst["exit_code"] = srv.proc.returncode if srv.proc is not None else None
        entry["l3_store"] = [_store(cfg, d) for d in dirs]
        if not args.keep_l3:
            shutil.rmtree(root, ignore_errors=True)


def _store(cfg: sharing.SharingConfig, path: Path) -> dict[str, Any]:
    try:
        return store_summary(configs.CONFIGS[cfg.base], path)
    except Exception as exc:  # noqa: BLE001 - a store layout the summary does not know yet
        return {"path": str(path), "error": repr(exc)[:500]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console, started = session.start(args, "sharing")
    served = run_model(args.model, args.dtype, args.gpu, args.server_arg)
    model, kvbpt = served.model, served.kv_bytes_per_token
    wl = workloads.multiturn(workloads.TokenSource(*workloads.token_range(model.path), salt=args.salt),
                             clients=args.clients, rounds=args.rounds, system_tokens=args.system_tokens,
                             user_tokens=args.user_tokens, answer_tokens=args.answer_tokens,
                             max_new_tokens=args.max_new_tokens)
    max_ctx = wl.max_context()
    device = args.device_tokens or configs.size_device_pool(max_ctx, args.page_size, args.device_factor)
    ratio = args.host_ratio or configs.host_ratio_for(device, sharing.staging_tokens(args.concurrency, INSTANCES, max_ctx))
    plan = configs.ServerPlan(page_size=args.page_size, device_tokens=device, host_ratio=ratio,
                              host_size_gb=args.hicache_size, gpu=args.gpu, l3_root=(args.l3_dir or args.out / "l3").resolve(),
                              kvtier_capacity_bytes=int(args.kvtier_capacity_gb * 1e9),
                              hicache_io_backend=args.hicache_io_backend, hicache_mem_layout=args.hicache_mem_layout,
                              extra_args=served.server_args, kvtier_extra=args.kvtier_extra)
    host = plan.host_tokens(kvbpt)
    assignment = sharing.predicted_workers(wl, INSTANCES)
    per_worker = sharing.per_worker_unique_tokens(wl, args.page_size, assignment, INSTANCES)
    ideal = sharing.ideal_cached_tokens(wl, args.page_size, assignment)
    pins = sharing.pinning(sorted(os.sched_getaffinity(0)), INSTANCES, args.cores_per_server)
    pin_words = ", ".join(f"instance {i} on CPU {','.join(map(str, c))}" for i, c in enumerate(pins) if c)
    if pin_words:
        pin_words = f"{args.cores_per_server} CPU (taskset, OMP_NUM_THREADS={args.cores_per_server}): {pin_words}"
    elif args.cores_per_server:
        console.print(f"[yellow]fewer than {INSTANCES * args.cores_per_server} usable CPUs: instances not pinned[/]")
    drop, policy = page_cache_policy(args.no_drop_caches)
    console.print(f"[bold]bench_sharing[/] model={model.name} {served.dtype} ({served.dtype_source}; {kvbpt} KV bytes/token); "
                  f"{INSTANCES} instances, device pool {device} + host pool {host} tokens each; {wl.description}; "
                  f"C={args.concurrency}; working set per instance {per_worker} tokens "
                  f"({min(per_worker) / max(device, host):.1f}x the larger pool); cached-token upper bounds: shared "
                  f"{ideal['shared']}, per instance {ideal['per_instance']}; page cache {policy}")
    run: dict[str, Any] = {
        "started": started, "argv": sys.argv if argv is None else argv, "args": args_json(args, ("configs",)),
        "gpu": args.gpu, "model": served.record(), "machine": session.machine(model, served.server_args),
        "page_cache": {"dropped": drop, "policy": policy}, "pinning": pins, "pinning_words": pin_words,
        "sizing": {"page_size": args.page_size, "device_tokens": device, "host_tokens": host, "host_ratio": ratio,
                   "hicache_size_gb": args.hicache_size, "max_context_tokens": max_ctx,
                   "per_worker_unique_tokens": per_worker, "ideal_cached": ideal},
        "workload_info": wl.summary(args.page_size), "concurrency": args.concurrency,
        "predicted_workers": assignment, "config_order": [c.name for c in args.configs], "configs": {},
    }  # fmt: skip
    if any(c.l3 for c in args.configs) and not args.gpu:
        run["hash_extension"] = prebuild_hash_extension()
    failed = 0
    try:
        with progress(console, disable=args.no_progress) as bars:
            task = bars.add_task("starting", total=len(args.configs) * len(wl.requests))
            for cfg in args.configs:
                entry = run["configs"].setdefault(cfg.name, {
                    "summary_text": cfg.summary, "shared": cfg.shared, "l3": cfg.l3,
                    "l3_where": "-" if not cfg.l3 else ("one dir" if cfg.shared else "one per instance"),
                    "l3_dirs": [str(d) for d in cfg.l3_dirs(plan, INSTANCES)]})
                try:
                    run_config(args, cfg, plan, model.path, wl, pins, drop, kvbpt, entry, bars, task, console)
                except Exception as exc:  # noqa: BLE001 - one broken configuration must not lose the others
                    failed += 1
                    entry["error"] = session.failure(console, cfg.name, exc)
                session.save(run, args.out)
    finally:
        run["targets"] = sharing_report.targets(run)
        run["ratios"] = sharing_report.ratios(run)
        session.finish(run, args.out, sharing_report.markdown, sharing_report.plots, console)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
