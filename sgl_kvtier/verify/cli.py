"""``sgl-kvtier verify``: the arguments, their checks, and the run (tables, ``verify.json`` / ``verify.md`` /
``verify.png`` under ``--out``; exit status 0 when every gate passed, 1 when one failed).

Arms: ``--arms`` names the levels to compare (default ``l3 hbm-only``); an arm with an ``--endpoint
ARM=URL[,URL...]`` is played on that running deployment, any other is started from ``--config`` (a
``sgl-kvtier launch`` TOML) with that level's tiers (``l2-only``: no [kvtier]; ``hbm-only``: no HiCache),
one at a time; arguments after ``--`` go to the servers it starts. Workload: a slice of a request trace
(``--trace``: Mooncake JSONL or SGLang request logs, as ``sgl-kvtier plan`` reads them), or the built-in
multi-turn chat. Gates compare ``l3`` with ``--baseline`` at every concurrency.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sgl_kvtier.errors import ConfigError, KVTierError
from sgl_kvtier.plan.model import Geometry
from sgl_kvtier.plan.trace import TraceFormat, load
from sgl_kvtier.serving.hardware import has_cuda_gpu
from sgl_kvtier.serving.launch import Offload
from sgl_kvtier.serving.launch import load as load_config
from sgl_kvtier.serving.workload import TokenSource, Workload, from_trace, multiturn, token_range
from sgl_kvtier.verify import report
from sgl_kvtier.verify.arms import Arm, config_model, model_path_of, parse_endpoint, serve
from sgl_kvtier.verify.gates import Gates, evaluate, passed
from sgl_kvtier.verify.runner import Settings, play_level, same_outputs

LEVELS = [o.value for o in Offload]


def add_verify_parser(sub: Any) -> None:
    """Add the ``verify`` sub-command to the CLI's sub-parsers."""
    p = sub.add_parser("verify", help="measure the L3 on a deployment against baselines without it; gated exit "
                       "status", description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("arms")
    g.add_argument("--arms", nargs="+", choices=LEVELS, default=["l3", "hbm-only"], help="levels to compare")
    g.add_argument("--endpoint", action="append", default=[], metavar="ARM=URL[,URL...]",
                   help="a running deployment for that arm (several URLs: requests routed by conversation)")
    g.add_argument("--config", type=Path, help="a launch TOML to start the arms without --endpoint from")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    g = p.add_argument_group("workload (default: the built-in multi-turn chat)")
    g.add_argument("--trace", type=Path, help="a Mooncake JSONL trace or SGLang request log(s)")
    g.add_argument("--format", choices=[f.value for f in TraceFormat], help="default: guessed")
    g.add_argument("--trace-requests", type=int, default=64, help="replay the first N requests of the trace")
    g.add_argument("--block-tokens", type=int, help="tokens per trace block when sent (default: the trace's)")
    g.add_argument("--max-tokens", type=int, default=8192, help="cut prompts at this length")
    g.add_argument("--time-scale", type=float, default=0.0,
                   help="replay arrivals x this (0: each request as soon as a slot frees)")
    g.add_argument("--warmup-fraction", type=float, default=0.25, help="of the trace slice, not measured")
    g.add_argument("--clients", type=int, default=8)
    g.add_argument("--rounds", type=int, default=3, help="round 1 warms up")
    g.add_argument("--system-tokens", type=int, default=1024)
    g.add_argument("--user-tokens", type=int, default=256)
    g.add_argument("--answer-tokens", type=int, default=64)
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--token-range", type=int, nargs=2, metavar=("LO", "HI"),
                   help="token ids to draw prompts from (default: from the model's config.json)")
    g.add_argument("--salt", type=int, help="prompt salt (default: from the clock, so no cache has seen them)")
    g = p.add_argument_group("measurement")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    g.add_argument("--flush-between-phases", action="store_true",
                   help="POST /flush_cache before each measured phase (prefixes then come from the L3 only)")
    g.add_argument("--backup-wait", type=float, default=30.0, help="max seconds to wait for L3 write-back")
    g = p.add_argument_group("gates (l3 against --baseline, at every concurrency)")
    g.add_argument("--baseline", choices=LEVELS, help="default: hbm-only if measured, else l2-only")
    g.add_argument("--min-ttft-p50-cut", type=float, default=0.25, help="TTFT p50 at least this much lower")
    g.add_argument("--min-ttft-p99-cut", type=float, help="TTFT p99 at least this much lower (off by default)")
    g.add_argument("--min-throughput-gain", type=float, default=0.29, help="requests/s at least this much higher")
    g.add_argument("--max-error-rate", type=float, default=0.0)
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, help="default ./verify-DATE-TIME/ (UTC)")
    g.add_argument("--json", action="store_true", help="print the record as JSON")
    g.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_verify)


def check(args: argparse.Namespace) -> tuple[list[Arm], str, Gates]:
    """The arms, the baseline and the gates; a bad argument is a ``ConfigError`` naming it."""
    given = {a.name: a for a in map(parse_endpoint, args.endpoint)}
    names = list(dict.fromkeys([*args.arms, *given]))
    if "l3" not in names:
        raise ConfigError("--arms", "must include l3: it is the arm under test")
    if len(names) < 2:
        raise ConfigError("--arms", "needs a baseline beside l3 (hbm-only or l2-only)")
    arms = [given.get(n, Arm(Offload(n))) for n in names]
    if any(a.started for a in arms) and args.config is None:
        raise ConfigError("--config", f"arms {', '.join(a.name for a in arms if a.started)} have no --endpoint: "
                          "give a launch config to start them from")
    baseline = args.baseline or ("hbm-only" if "hbm-only" in names else "l2-only")
    if baseline not in names or baseline == "l3":
        raise ConfigError("--baseline", f"must be a measured arm other than l3 ({', '.join(names)})")
    for name in ("concurrency",):
        if any(c < 1 for c in args.concurrency):
            raise ConfigError(name, "every value must be >= 1")
    for name in ("trace_requests", "max_tokens", "clients", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(name, f"must be >= 1, got {getattr(args, name)}")
    if args.rounds < 2:
        raise ConfigError("rounds", "must be >= 2 (round 1 warms up)")
    if not 0 < args.warmup_fraction < 1:
        raise ConfigError("warmup_fraction", f"must be in (0, 1), got {args.warmup_fraction}")
    try:
        gates = Gates(args.min_ttft_p50_cut, args.min_ttft_p99_cut, args.min_throughput_gain, args.max_error_rate)
    except ValueError as exc:
        raise ConfigError("gates", str(exc)) from None
    return arms, baseline, gates


def model_dir(arms: list[Arm], doc: dict[str, Any] | None, gpu: bool) -> Path | None:
    """A local model directory of the deployment: the config's, or one a running endpoint reports."""
    if doc is not None:
        return config_model(doc, gpu)
    for arm in (a for a in arms if a.urls):
        path = model_path_of(arm.urls[0])
        if path and (Path(path) / "config.json").is_file():
            return Path(path)
    return None


def workloads(args: argparse.Namespace, lo_hi: tuple[int, int], salt: int) -> dict[int, Workload]:
    """One workload per concurrency level, salted ``salt + i``: same prompts on every arm, cold per level."""
    trace = None
    if args.trace is not None:
        trace = load(args.trace, TraceFormat(args.format) if args.format else None).head(requests=args.trace_requests)
    out = {}
    for i, c in enumerate(args.concurrency):
        src = TokenSource(*lo_hi, salt=salt + i)
        if trace is not None:
            out[c] = from_trace(src, trace, block_tokens=args.block_tokens or trace.block_tokens,
                                max_tokens=args.max_tokens, max_new_tokens=args.max_new_tokens,
                                time_scale=args.time_scale, warmup_fraction=args.warmup_fraction)
        else:
            out[c] = multiturn(src, clients=args.clients, rounds=args.rounds, system_tokens=args.system_tokens,
                               user_tokens=args.user_tokens, answer_tokens=args.answer_tokens,
                               max_new_tokens=args.max_new_tokens)
    return out


def cmd_verify(args: argparse.Namespace, console: Console) -> int:
    arms, baseline, gates = check(args)
    doc = load_config(args.config) if args.config is not None else None
    gpu = has_cuda_gpu()
    model = model_dir(arms, doc, gpu)
    if args.token_range is not None:
        lo_hi = (args.token_range[0], args.token_range[1])
    elif model is not None:
        lo_hi = token_range(model)
    else:
        raise ConfigError("--token-range", "the model's config.json is not readable here: give the token ids to use")
    try:
        kvbpt = Geometry.from_config(model).pool_bytes_per_token if model is not None else 0
    except ConfigError:
        kvbpt = 0
    salt = args.salt if args.salt is not None else int(time.time())
    wls = workloads(args, lo_hi, salt)
    out = (args.out or Path(f"verify-{datetime.now(UTC):%Y%m%d-%H%M%S}")).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    command = shlex.join(["sgl-kvtier", *sys.argv[1:]]) if sys.argv[1:2] == ["verify"] else "sgl-kvtier verify"
    settings = Settings(args.backup_wait, args.flush_between_phases)
    first = next(iter(wls.values()))
    page = int(doc.get("sglang", {}).get("page_size", 1)) if doc is not None else 1
    run: dict[str, Any] = {
        "command": command, "started": datetime.now(UTC).isoformat(timespec="seconds"), "host": report.host_line(),
        "model": str(model) if model else None, "salt": salt, "workload": first.summary(page) | {"salt": salt},
        "settings": {"flush_between_phases": settings.flush, "backup_wait_s": settings.backup_wait_s},
        "under_test": "l3", "baseline": baseline, "gates": gates.__dict__, "arms": {},
    }
    total = sum(len(w.requests) for w in wls.values()) * len(arms)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), disable=args.no_progress) as bars:
        task = bars.add_task("verify", total=total)
        for arm in sorted(arms, key=lambda a: a.name != baseline):  # the baseline first: outputs compare to it
            entry: dict[str, Any] = {"levels": {}}
            run["arms"][arm.name] = entry
            try:
                bars.update(task, description=f"{arm.name}: starting" if arm.started else arm.name)
                with serve(arm, doc, gpu=gpu, log_dir=out / "logs", startup_timeout_s=args.startup_timeout,
                           extra_args=tuple(getattr(args, "extra", []) or ())) as serving:
                    entry["serving"] = serving.__dict__ | {"urls": list(serving.urls), "command": list(serving.command)}
                    for c, wl in wls.items():
                        bars.update(task, description=f"{arm.name} C={c}")
                        level = play_level(serving.urls, wl, c, settings, l3=arm.offload is Offload.L3,
                                           kv_bytes_per_token=kvbpt, on_done=lambda _r: bars.advance(task))
                        base = run["arms"].get(baseline, {}).get("levels", {}).get(str(c))
                        level["same_output"] = same_outputs(level, base) if arm.name != baseline else None
                        entry["levels"][str(c)] = level
            except (KVTierError, RuntimeError, OSError, ValueError) as exc:  # ServerError is a RuntimeError
                # an arm that fails is reported and its gates judged NO_DATA; the other arms still run
                entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                console.print(f"[red]{arm.name} failed: {entry['error']}[/red]")
    cells = {name: {int(c): lv["summary"] for c, lv in a["levels"].items()} for name, a in run["arms"].items()}
    results = evaluate(gates, cells.get("l3", {}), cells.get(baseline, {}), levels=args.concurrency)
    run["verdicts"] = [r.as_dict() for r in results]
    run["passed"] = passed(results)
    (out / "verify.json").write_text(json.dumps(run, indent=1, default=str) + "\n")
    (out / "verify.md").write_text(report.markdown(run))
    png = report.plot(run, out / "verify.png")
    if args.json:
        print(json.dumps({k: v for k, v in run.items() if k != "arms"} | {"out": str(out)}, indent=2, default=str))
    else:
        arms_table, gates_table = report.tables(run)
        wide = console if console.is_terminal and console.width >= 150 else Console(width=150)
        wide.print(arms_table)
        wide.print(gates_table)
        console.print(f"{'[green]PASSED' if run['passed'] else '[red]FAILED'}[/] - wrote {out}/verify.json, "
                      "verify.md" + (", verify.png" if png else " (no verify.png: pip install 'sgl-kvtier[plan]')"))
    return 0 if run["passed"] else 1
