"""TTFT of four L3 prefetch policies on real SGLang servers, with a fast and a slow (throttled) L3 device.

The policies: recompute (L3 never loaded), load-all (`wait_complete`), SGLang's default `timeout`, and
ours (`timeout` + `KVTIER_PREFETCH_POLICY=cost`).

Each (device setting, policy) pair gets its own real `sglang.launch_server` (HiCache + sgl-kvtier L3, a fresh
L3 directory) serving the same prompts: a write round puts D long document prefixes in L3, then every
later round flushes L1 + L2 (after the L3 write-back has drained) and drops the page cache, and asks one new
question per document, so each prefix is in L3 only when its request arrives. The first of those rounds
is unmeasured (it primes the cost model's read-speed estimate); the rest are measured at each
concurrency level. See docs/benchmarks/policy.md.

    python -m benchmarks.bench_policy --devices fast slow:4 --concurrency 1 4
    python -m benchmarks.bench_policy --smoke
    python -m benchmarks.bench_policy --help

Writes <out>/results.json (every request and /metrics delta, the exact server commands and environment),
<out>/report.md and <out>/ttft_by_policy.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import page_cache_policy, progress
from benchmarks.serving import configs, policy_report, session, workloads
from benchmarks.serving.models import run_model
from benchmarks.serving.policies import POLICIES, parse_device, prefix_rounds, resolve_policies, unique_tokens
from benchmarks.serving.probes import prebuild_hash_extension, store_summary
from benchmarks.serving.settle import settle
from sgl_kvtier.serving import client, summary
from sgl_kvtier.serving.hardware import AUTO, DTYPE_BYTES

KVTIER = configs.CONFIGS["e"]  # HiCache + sgl-kvtier L3: the server every policy runs
SMOKE = {"model": "tiny", "devices": ["slow:2"], "policies": ["load-all", "cost"], "concurrency": [1],
         "documents": 2, "doc_tokens": 512, "question_tokens": 32, "rounds": 1, "prime_rounds": 1,
         "backup_wait": 120.0, "kvtier_capacity_gb": 0.25}  # L3 under one 1 GiB segment (small CI disks)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help=f"tiny model, few requests, two policies, one slow device (explicit flags still win): {SMOKE}")
    p.add_argument("--model", default="bench", help="tiny | bench | kvheavy (random models made offline) or a model path")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *sorted(DTYPE_BYTES)],
                   help="model and KV dtype; auto: KVTIER_MODEL_DTYPE, else bfloat16 on a GPU or a CPU with "
                        "AVX512-BF16/AMX, else float32 (a model path on a GPU: its config.json's)")
    p.add_argument("--devices", nargs="+", default=["fast", "slow:4"],
                   help="device settings: 'fast' (the L3 directory as it is) or 'slow:READ_MBPS[:WRITE_MBPS]' "
                        "(sgl-kvtier's ThrottledEngine; writes default to the read cap)")
    p.add_argument("--slow-latency-ms", type=float, default=2.0, help="latency added per IO on slow settings")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), help=f"subset of {list(POLICIES)}")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    p.add_argument("--out", type=Path, help="default benchmarks/results/policy-<timestamp>/")
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--gpu", dest="gpu", action="store_true", default=None, help="GPU flags (default: auto-detect)")
    dev.add_argument("--cpu", dest="gpu", action="store_false", help="CPU route even if a GPU is present")
    g = p.add_argument_group("workload")
    g.add_argument("--documents", type=int, default=8, help="documents (requests per round)")
    g.add_argument("--doc-tokens", type=int, default=1536, help="tokens of each document: the prefix in L3")
    g.add_argument("--question-tokens", type=int, default=64, help="the suffix every request computes")
    g.add_argument("--rounds", type=int, default=2, help="measured rounds per concurrency level")
    g.add_argument("--prime-rounds", type=int, default=1, help="unmeasured L3 rounds after the write round")
    g.add_argument("--max-new-tokens", type=int, default=4)
    g = p.add_argument_group("server")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--device-tokens", type=int, help="--max-total-tokens; default 1.25x max concurrency x the longest request")
    g.add_argument("--host-ratio", type=float,
                   help="--hicache-ratio; default: room for (documents + 2 x max concurrency) x the longest "
                        "request: a round's pages wait in the host pool until the L3 write-back has them, and "
                        "SGLang declines a prefetch while in-flight ones hold half of the host pool")
    g.add_argument("--prefill-tokens-per-s", type=float,
                   help="KVTIER_PREFILL_TOKENS_PER_S for the cost policy (a seed; it learns from SGLang's batches)")
    g.add_argument("--kvtier-capacity-gb", type=float, default=8.0)
    g.add_argument("--kvtier-extra", type=json.loads, default={},
                   help='more keys for every server\'s sgl-kvtier extra config, e.g. \'{"readahead_bytes": 0}\'')
    g.add_argument("--server-arg", action="append", default=[], help="extra launch_server argument (repeatable)")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    g = p.add_argument_group("measurement")
    g.add_argument("--l3-dir", type=Path, help="where the L3 stores go (default <out>/l3)")
    g.add_argument("--keep-l3", action="store_true", help="keep each server's L3 directory")
    g.add_argument("--no-drop-caches", action="store_true", help="do not drop the OS page cache between rounds")
    g.add_argument("--backup-wait", type=float, default=600.0,
                   help="max seconds to wait for L3 write-back before each flush (a slow device writes slowly)")
    g.add_argument("--backup-stall", type=float, default=60.0,
                   help="stop waiting for write-back once the backed-up token count has not moved for this long")
    g.add_argument("--no-progress", action="store_true")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    args.device_settings = [parse_device(d, args.slow_latency_ms) for d in args.devices]
    args.policy_list = resolve_policies(args.policies)
    return args


def run_server(args, device, policy, plan, model_dir, rounds, drop, kvbpt, bars, task, console) -> dict[str, Any]:
    from sgl_kvtier.serving.server import SGLangServer, tracebacks_through

    tag = f"{device.name}-{policy.name}"
    plan = dataclasses.replace(plan, l3_root=plan.l3_root / tag, extra_args=policy.server_args + plan.extra_args,
                               kvtier_extra={**dict(policy.kvtier_extra), **device.kvtier_extra(), **args.kvtier_extra})
    l3 = KVTIER.l3_dir(plan)
    shutil.rmtree(l3, ignore_errors=True)
    l3.mkdir(parents=True, mode=0o700)
    env = dict(policy.env)
    if policy.name == "cost" and args.prefill_tokens_per_s:
        env["KVTIER_PREFILL_TOKENS_PER_S"] = f"{args.prefill_tokens_per_s:g}"
    srv = SGLangServer(model_dir, extra_args=KVTIER.args(plan), env=env, log_path=args.out / "logs" / f"{tag}.log",
                       cpu=not plan.gpu, startup_timeout_s=args.startup_timeout)
    res: dict[str, Any] = {"command": srv.command, "command_str": shlex.join(srv.command), "env": env,
                           "log": str(srv.log_path), "rounds": [], "levels": {}}
    bars.update(task, description=f"{tag}: starting server")
    srv.start()
    res["startup_s"], res["gc_frozen"] = srv.startup_s, srv.gc_frozen
    unique = unique_tokens(rounds, plan.page_size)
    try:
        base = client.counters(client.scrape(srv.url))["backuped_tokens"]
        for i, rnd in enumerate(rounds):
            pre = settle(args, srv, unique, i, base, drop, console) if i else {}
            bars.update(task, description=f"{tag}: {rnd.kind} round {i} (C={rnd.concurrency})")
            m = session.measure_phase(srv, rnd.requests, rnd.concurrency, lambda _r: bars.advance(task))
            res["rounds"].append({"index": i, "kind": rnd.kind, "concurrency": rnd.concurrency,
                                  "measured": rnd.kind == "measured", "settle": pre, **m})
        for c in sorted({r.concurrency for r in rounds if r.kind == "measured"}):
            phases = [r for r in res["rounds"] if r["measured"] and r["concurrency"] == c]
            s = res["levels"][str(c)] = summary.summarize(phases, kvbpt)
            console.log(f"{tag:28s} C={c}: TTFT p50 {s['ttft_p50_s']:.2f} s p99 {s['ttft_p99_s']:.2f} s, L3 tokens "
                        f"used {s['cached_tokens']['storage']} of {s['prompt_tokens']}, {s['errors']} errors")
    finally:
        res["exit_code"] = srv.stop()
        res["l3_store"] = store_summary(KVTIER, l3)
        res["sgl_kvtier_tracebacks"] = len(tracebacks_through(srv.log_path.read_text(errors="replace")))
        if not args.keep_l3:
            shutil.rmtree(l3, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console, started = session.start(args, "policy")
    served = run_model(args.model, args.dtype, args.gpu, args.server_arg)
    model, server_args = served.model, list(served.server_args)
    model_dir, model_name = model.path, model.name
    dtype, dtype_source, kvbpt = served.dtype, served.dtype_source, served.kv_bytes_per_token
    src = workloads.TokenSource(*workloads.token_range(model_dir), salt=0)
    rounds = prefix_rounds(src, documents=args.documents, doc_tokens=args.doc_tokens,
                           question_tokens=args.question_tokens, concurrency=args.concurrency, rounds=args.rounds,
                           prime_rounds=args.prime_rounds, max_new_tokens=args.max_new_tokens)
    longest = max(len(r.tokens) + r.max_new_tokens for rnd in rounds for r in rnd.requests)
    # Room for max C requests at once: the flushes, not the pool size, keep the prefixes out of L1 and L2.
    device = args.device_tokens or configs.size_device_pool(max(args.concurrency) * longest, args.page_size, 1.25)
    ratio = args.host_ratio or configs.host_ratio_for(device, (args.documents + 2 * max(args.concurrency)) * longest)
    plan = configs.ServerPlan(page_size=args.page_size, device_tokens=device, host_ratio=ratio, host_size_gb=0,
                              gpu=args.gpu, l3_root=(args.l3_dir or args.out / "l3").resolve(),
                              kvtier_capacity_bytes=int(args.kvtier_capacity_gb * 1e9), extra_args=tuple(server_args))
    drop, cache_policy = page_cache_policy(args.no_drop_caches)
    prefix_mb = args.doc_tokens * kvbpt / 1e6
    description = (f"{args.documents} documents x {args.doc_tokens} tokens ({prefix_mb:.1f} MB of KV each) + "
                   f"{args.question_tokens}-token questions; 1 write round, {args.prime_rounds} prime round(s), "
                   f"{args.rounds} measured round(s) per C in {args.concurrency}; {args.max_new_tokens} new tokens")
    console.print(f"[bold]bench_policy[/] model={model_name} {dtype} ({dtype_source}; {kvbpt} KV bytes/token) "
                  f"{'GPU' if args.gpu else 'CPU'}; "
                  f"{description}; device pool {device}, host pool {plan.host_tokens(kvbpt)} tokens; page cache "
                  f"{cache_policy}")
    for d in args.device_settings:
        if d.read_mbps:
            console.print(f"  {d.name}: loading one {prefix_mb:.1f} MB prefix takes >= {prefix_mb / d.read_mbps:.2f} s")
    run: dict[str, Any] = {
        "started": started, "argv": sys.argv if argv is None else argv, "gpu": args.gpu,
        "args": {k: v for k, v in vars(args).items() if k not in ("device_settings", "policy_list")},
        "model": served.record(),
        "machine": session.machine(model, server_args),
        "page_cache": cache_policy,
        "sizing": {"page_size": args.page_size, "device_tokens": device, "host_tokens": plan.host_tokens(kvbpt),
                   "host_ratio": ratio, "longest_request_tokens": longest},
        "workload": {"description": description, "rounds": [{"kind": r.kind, "concurrency": r.concurrency,
                                                             "requests": len(r.requests)} for r in rounds]},
        "devices": {d.name: {"description": d.describe(), "throttle": d.throttle} for d in args.device_settings},
        "device_order": [d.name for d in args.device_settings],
        "policies": {p.name: p.summary for p in args.policy_list}, "policy_order": [p.name for p in args.policy_list],
        "runs": {},
    }  # fmt: skip
    if not args.gpu:
        run["hash_extension"] = prebuild_hash_extension()
    per_server = sum(len(r.requests) for r in rounds)
    total = per_server * len(args.device_settings) * len(args.policy_list)
    failed = 0
    try:
        with progress(console, disable=args.no_progress) as bars:
            task = bars.add_task("starting", total=total)
            for dev in args.device_settings:
                for policy in args.policy_list:
                    slot = run["runs"].setdefault(dev.name, {})
                    try:
                        slot[policy.name] = run_server(args, dev, policy, plan, model_dir, rounds, drop, kvbpt,
                                                       bars, task, console)
                    except Exception as exc:  # noqa: BLE001 - one broken server must not lose the others
                        failed += 1
                        slot[policy.name] = {"error": session.failure(console, f"{dev.name} / {policy.name}", exc),
                                             "levels": {}}
                    session.save(run, args.out)
    finally:
        session.finish(run, args.out, policy_report.markdown, policy_report.plot, console)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
