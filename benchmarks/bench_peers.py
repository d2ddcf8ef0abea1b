"""sgl-kvtier against the L3 systems an SGLang operator would pick instead: one model, one workload, one run.

Systems (``benchmarks.peers``, one module each): recompute and radix (no HiCache), SGLang's built-in ``file`` L3,
sgl-kvtier, Mooncake Store (DRAM pool; SSD offload), NIXL (POSIX plugin, O_DIRECT), LMCache (its own connector,
replacing HiCache), AIBrix KV cache (RocksDB) and SeaweedFS (S3). One after another, each gets its services
(Mooncake's master, LMCache's daemon, SeaweedFS) and one real ``sglang.launch_server`` on the same model, all in a
memory cgroup of its own whose limit leaves the page cache far less room than the L3 working set
(``benchmarks.peers.cgroup``), and plays the multi-turn workload at each concurrency (bench_serving's machinery:
``benchmarks.serving``). Everything it started is torn down after each system, also on failure or a signal.
Peer packages live in an overlay venv (``benchmarks.peers.venv``: ``.venv-peers``, pinned by
``benchmarks/peers/constraints.txt``); a system that cannot install or start is skipped with the reason.

    python -m benchmarks.bench_peers --install                  # every system, C = 1 4 16, kvheavy model
    python -m benchmarks.bench_peers --systems file kvtier mooncake-dram --concurrency 1 4
    python -m benchmarks.bench_peers --smoke                    # recompute + kvtier, one conversation, tiny model
    python -m benchmarks.bench_peers --help

Writes <out>/results.json (every request, per-phase cgroup readings, versions, commands, skip reasons),
<out>/report.md and <out>/peers.png. See docs/benchmarks/peers.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import page_cache_policy, progress
from benchmarks.peers import SYSTEMS, cgroup, resolve
from benchmarks.peers import report as peers_report
from benchmarks.peers.system import Context, Service, Skip, System
from benchmarks.peers.venv import DEFAULT, PeersVenv
from benchmarks.serving import configs, session, workloads
from benchmarks.serving.models import run_model
from benchmarks.serving.probes import prebuild_hash_extension
from sgl_kvtier.serving.hardware import AUTO, DTYPE_BYTES

EXT_DIR = "TORCH_EXTENSIONS_DIR"
SMOKE = {"systems": ["recompute", "kvtier"], "model": "tiny", "concurrency": [1], "clients": 1, "rounds": 2,
         "system_tokens": 256, "user_tokens": 128, "answer_tokens": 32, "max_new_tokens": 4,
         "flush_between_phases": True, "no_drop_caches": True, "page_cache_mb": 64, "kvtier_capacity_gb": 0.25,
         "install": False}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), help=f"subset of {list(SYSTEMS)}")
    p.add_argument("--model", default="kvheavy", help="tiny | bench | kvheavy (random models made offline) or a path")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *sorted(DTYPE_BYTES)], help="model and KV dtype")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--smoke", action="store_true",
                   help="CPU-sized end-to-end check (explicit flags still win): "
                        + ", ".join(f"{k}={v}" for k, v in SMOKE.items()))
    p.add_argument("--out", type=Path, help="default benchmarks/results/peers-<timestamp>/")
    session.add_device_args(p)
    g = session.add_multiturn_args(p, clients=8, rounds=3, system_tokens=256, user_tokens=128, answer_tokens=16)
    g.add_argument("--max-new-tokens", type=int, default=4)
    g = p.add_argument_group("server")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--device-tokens", type=int, help="--max-total-tokens; default: --device-factor x longest request")
    g.add_argument("--device-factor", type=float, default=1.25)
    g.add_argument("--host-ratio", type=float, default=1.5,
                   help="--hicache-ratio (host pool = ratio x device pool); LMCache's L1 and the SSD-offload "
                        "Mooncake segment get the same bytes")
    g.add_argument("--server-arg", action="append", default=[], help="extra launch_server argument (repeatable)")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    g = p.add_argument_group("peers, memory cgroup and measurement")
    g.add_argument("--install", action=argparse.BooleanOptionalAction, default=True,
                   help="install missing peer packages into the peers venv (else skip those systems)")
    g.add_argument("--peers-venv", type=Path, default=DEFAULT, help="the overlay venv of the peer packages")
    g.add_argument("--page-cache-mb", type=int, default=64,
                   help="page cache each cgroup allows above its processes' resident memory (its limit follows that)")
    g.add_argument("--margin-mb", type=int, default=32,
                   help="what each cgroup's limit allows on top for allocations between two updates (0.1 s)")
    g.add_argument("--no-cgroup", action="store_true", help="no memory cgroup (the page cache may hold the L3)")
    g.add_argument("--l3-dir", type=Path, help="where the stores go (default <out>/l3); put it on the flash to measure")
    g.add_argument("--kvtier-capacity-gb", type=float, default=8.0)
    g.add_argument("--keep-l3", action="store_true", help="keep each system's store directory")
    g.add_argument("--flush-between-phases", action=argparse.BooleanOptionalAction, default=False,
                   help="POST /flush_cache before each measured phase (deterministic L3 hits; the smoke mode's)")
    g.add_argument("--no-drop-caches", action="store_true", help="do not drop the OS page cache between phases")
    g.add_argument("--backup-wait", type=float, default=60.0, help="max seconds to wait for L3 write-back per phase")
    g.add_argument("--no-progress", action="store_true")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    args.argv = argv
    try:
        args.systems = resolve(args.systems)
    except ValueError as exc:
        p.error(str(exc))
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (round 1 is the warm-up)")
    return args


def workload_levels(args: argparse.Namespace, lo_hi: tuple[int, int]) -> dict[tuple[str, int, int], workloads.Workload]:
    """bench_serving's multi-turn workload, one salt per concurrency level (each level starts cold)."""
    return {("multiturn", li, c): workloads.multiturn(
        workloads.TokenSource(*lo_hi, salt=li), clients=args.clients, rounds=args.rounds,
        system_tokens=args.system_tokens, user_tokens=args.user_tokens, answer_tokens=args.answer_tokens,
        max_new_tokens=args.max_new_tokens) for li, c in enumerate(args.concurrency)}


def server(args: argparse.Namespace, system: System, ctx: Context, model_dir: Path,
           cg: cgroup.MemoryCgroup | None) -> tuple[Any, list[str]]:
    """The system's SGLang server (not started yet), on its interpreter and in its cgroup; and its command as
    the report shows it (the cgroup wrapper aside)."""
    from sgl_kvtier.serving.server import SGLangServer

    srv = SGLangServer(model_dir, extra_args=system.server_args(ctx), env=system.server_env(ctx),
                       log_path=ctx.log_dir / f"{system.name}.log", cpu=not args.gpu,
                       startup_timeout_s=args.startup_timeout)
    python = system.python(ctx)
    if python:
        srv.command[0] = python
    shown = list(srv.command)
    if cg is not None:
        srv.command = cg.wrap(srv.command)
    return srv, shown


def phase_probe(system: System, ctx: Context, cg: cgroup.MemoryCgroup | None) -> session.Probe:
    """The readings kept before and after each phase: the cgroup's (each resets its peak, so the next one's is
    the phase's) and what the system reports of its store."""
    def probe() -> dict[str, float]:
        out = {}
        if cg is not None:
            out = cg.snapshot()
            cg.reset_peak()
        return out | system.readings(ctx)

    return probe


def run_system(args: argparse.Namespace, system: System, ctx: Context, model_dir: Path, wls: dict[Any, Any],
               drop: bool, bars: Any, task: Any, console: Any, parent: Path | None) -> dict[str, Any]:
    """Prepare, start, measure and tear down one system; its result (``skipped`` with the reason if it could not
    run, ``error`` if it failed part-way: what was measured stays)."""
    res: dict[str, Any] = system.describe() | {"workloads": {}}
    bars.update(task, description=f"{system.name}: preparing")
    try:
        system.prepare(ctx, args.install)
    except Skip as exc:
        res["skipped"] = str(exc)
        res["versions"] = ctx.venv.versions(system.packages)  # what there is ("not installed")
        console.print(f"[yellow]{system.name}: skipped: {exc}[/]")
        return res
    res["versions"] = system.versions(ctx)
    shutil.rmtree(ctx.work, ignore_errors=True)
    ctx.work.mkdir(parents=True, mode=0o700)
    cg = cgroup.MemoryCgroup.create(parent, system.name) if parent is not None else None
    cap = cgroup.Cap(cg, args.page_cache_mb * cgroup.MiB, args.margin_mb * cgroup.MiB) if cg is not None else None
    services: list[Service] = []
    srv = None
    try:
        services = system.services(ctx)
        for svc in services:
            bars.update(task, description=f"{system.name}: starting {svc.name}")
            svc.start(cg)
        srv, shown = server(args, system, ctx, model_dir, cg)
        res |= {"command": srv.command, "command_str": shlex.join(shown), "log": str(srv.log_path),
                "env": {k: v for k, v in srv.env.items() if os.environ.get(k) != v}}
        bars.update(task, description=f"{system.name}: starting server")
        srv.start()
        res["startup_s"] = srv.startup_s
        if cg is not None and cap is not None:
            # Up and idle: the limit starts following. Not before: SGLang sizes the host pool against the
            # cgroup's free room (pool_host.base.host_memory_budget_bytes) and refuses to start under a tight one.
            cap.start()
            res["cgroup"] = {"path": str(cg.path), "stat_at_start": cg.stat()}
        session.serve_levels(args, srv, wls, ctx.plan.page_size, label=system.name, l3=system.l3,
                             flush=system.flush, drop=drop, kvbpt=ctx.kv_bytes_per_token, bars=bars, task=task,
                             console=console, into=res["workloads"], probe=phase_probe(system, ctx, cg))
    except Skip as exc:
        res["skipped"] = str(exc)
        console.print(f"[yellow]{system.name}: skipped: {exc}[/]")
    except Exception as exc:  # noqa: BLE001 - one broken system must not lose the others
        session.failure(console, system.name, exc)
        text = repr(exc)  # its head (what failed) and its tail (a server's log ends with the cause)
        res["error"] = text if len(text) <= 4000 else f"{text[:1000]} ... {text[-3000:]}"
    finally:
        if cap is not None:
            cap.stop()
        if cg is not None:
            res.setdefault("cgroup", {"path": str(cg.path)})["end"] = _safe(cg.snapshot)
            res["cgroup"]["cap"] = cap.record() if cap is not None else None
        res["store"] = store_bytes(ctx.work)  # before the stop: a store may clean up after itself
        if srv is not None:
            res["exit_code"] = srv.stop()
        res["services"] = []
        for svc in reversed(services):
            svc.stop()
            res["services"].insert(0, svc.record())
        if cg is not None:
            cg.remove()
        if not args.keep_l3:
            shutil.rmtree(ctx.work, ignore_errors=True)
    return res


def _safe(read: Any) -> Any:
    try:
        return read()
    except OSError as exc:
        return {"error": repr(exc)}


def store_bytes(path: Path) -> dict[str, Any]:
    """Files and bytes a system left in its directory (its L3 store, logs of its services)."""
    files = [f for f in path.rglob("*") if f.is_file()] if path.exists() else []
    return {"path": str(path), "files": len(files), "bytes": sum(f.stat().st_size for f in files)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console, started = session.start(args, "peers")
    served = run_model(args.model, args.dtype, args.gpu, args.server_arg)
    model_dir, kvbpt = served.model.path, served.kv_bytes_per_token
    wls = workload_levels(args, workloads.token_range(model_dir))
    max_ctx = max(wl.max_context() for wl in wls.values())
    device = args.device_tokens or configs.size_device_pool(max_ctx, args.page_size, args.device_factor)
    l3_root = (args.l3_dir or args.out / "l3").resolve()
    plan = configs.ServerPlan(page_size=args.page_size, device_tokens=device, host_ratio=args.host_ratio,
                              host_size_gb=0, gpu=args.gpu, l3_root=l3_root,
                              kvtier_capacity_bytes=int(args.kvtier_capacity_gb * 1e9),
                              extra_args=tuple(served.server_args))
    host = plan.host_tokens(kvbpt)
    first = next(iter(wls.values()))
    info = first.summary(args.page_size)
    working_set = info["unique_prefix_tokens_cumulative"][-1] * kvbpt
    drop, policy = page_cache_policy(args.no_drop_caches)
    no_cgroup = "--no-cgroup" if args.no_cgroup else cgroup.unavailable()
    venv = PeersVenv(args.peers_venv.resolve())
    run: dict[str, Any] = {
        "started": started, "argv": args.argv, "command": shlex.join(["python", "-m", "benchmarks.bench_peers", *args.argv]),
        "gpu": args.gpu, "smoke": args.smoke,
        "model": served.record(), "machine": session.machine(served.model, served.server_args),
        "page_cache": {"dropped": drop, "policy": policy, "flush_between_phases": args.flush_between_phases},
        "sizing": {"page_size": args.page_size, "device_tokens": device, "host_tokens": host,
                   "host_ratio": args.host_ratio, "max_context_tokens": max_ctx, "working_set_bytes": working_set,
                   "host_pool_bytes": host * kvbpt, "page_cache_allowance_bytes": args.page_cache_mb * cgroup.MiB,
                   "margin_bytes": args.margin_mb * cgroup.MiB},
        "cgroup": {"used": no_cgroup is None, "why_not": no_cgroup,
                   "warning": cgroup.allowance_warning((args.page_cache_mb + args.margin_mb) * cgroup.MiB, working_set)},
        "peers_venv": str(venv.path), "workloads": ["multiturn"], "workload_info": {"multiturn": info},
        "concurrency": args.concurrency, "system_order": [s.name for s in args.systems], "systems": {},
    }  # fmt: skip
    console.print(f"[bold]bench_peers[/] model={served.model.name} {served.dtype} ({kvbpt} KV bytes/token); device "
                  f"pool {device} tokens, host pool {host} tokens ({host * kvbpt / 1e9:.2f} GB); L3 working set per "
                  f"level {working_set / 1e9:.2f} GB = {working_set / max(1, host * kvbpt):.1f}x the host pool; "
                  f"page cache {policy}; cgroup: {f'page cache at most {args.page_cache_mb + args.margin_mb} MiB' if no_cgroup is None else 'NONE (' + no_cgroup + ')'}")
    if max(args.concurrency) > args.clients:
        console.print(f"  [yellow]C={max(args.concurrency)} > {args.clients} conversations: at most {args.clients} "
                      "requests are in flight (a conversation's rounds go one after another)[/]")
    if run["cgroup"]["warning"]:
        console.print(f"  [yellow]{run['cgroup']['warning']}[/]")
    parent = None
    if no_cgroup is None:
        own = cgroup.own()
        assert own is not None
        parent = own / f"kvtier-peers-{os.getpid()}"
        parent.mkdir(exist_ok=True)
    ext_before = os.environ.get(EXT_DIR)
    # A SIGTERM tears down like an error does (the finally blocks stop every server, service and cgroup).
    sigterm_before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    total = len(args.systems) * sum(len(wl.requests) for wl in wls.values())
    failed = 0
    try:
        os.environ.setdefault(EXT_DIR, str(hash_extension_dir()))
        if any(s.hicache for s in args.systems) and not args.gpu:
            run["hash_extension"] = prebuild_hash_extension() | {"dir": os.environ[EXT_DIR]}
        with progress(console, disable=args.no_progress) as bars:
            task = bars.add_task("starting", total=total)
            for system in args.systems:
                ctx = Context(plan=plan, work=l3_root / system.name, venv=venv, kv_bytes_per_token=kvbpt,
                              host_pool_bytes=host * kvbpt, working_set_bytes=working_set, log_dir=args.out / "logs",
                              run_id=started)
                res = run_system(args, system, ctx, model_dir, wls, drop, bars, task, console, parent)
                res["dram_store_bytes"] = system.dram_store_bytes(ctx)
                failed += "error" in res
                run["systems"][system.name] = res
                # a skipped or failed system's requests will never come: keep the bar honest
                done = sum(len(ph["requests"]) for lv in res["workloads"].get("multiturn", []) for ph in lv["phases"])
                bars.advance(task, sum(len(wl.requests) for wl in wls.values()) - done)
                session.save(run, args.out)
    finally:
        if parent is not None:
            for child in parent.iterdir() if parent.exists() else []:
                if child.is_dir():
                    cgroup.MemoryCgroup(child).remove()
            cgroup.MemoryCgroup(parent).remove()
        signal.signal(signal.SIGTERM, sigterm_before)
        if ext_before is None:
            os.environ.pop(EXT_DIR, None)
        peers_report.compare_outputs(run)
        session.finish(run, args.out, peers_report.markdown, peers_report.plots, console)
    return 1 if failed else 0


def hash_extension_dir() -> Path:
    """Where SGLang's HiCache hash extension (torch JIT) is built for the servers: one directory per Python, torch
    and SGLang release, kept between runs. In the shared ~/.cache/torch_extensions another SGLang release builds
    other sources under the same name, so a server's storage thread would rebuild it in its first query (and a
    /flush_cache meanwhile kills the scheduler); a directory of a run's own would be built afresh every run."""
    from importlib import metadata

    release = (f"py{sys.version_info.major}{sys.version_info.minor}-torch{metadata.version('torch')}-"
               f"sglang{metadata.version('sglang')}")
    return Path.home() / ".cache" / "sgl-kvtier" / "torch_extensions" / release

if __name__ == "__main__":
    raise SystemExit(main())
