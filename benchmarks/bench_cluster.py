"""One pool shared by writers on several hosts (``sharing = "cluster"``), at the store level: hit rate, wrong
bytes, and what following the other writers costs as their number grows.

    python -m benchmarks.bench_cluster                               # 4 hosts; 1, 2, 4, 8 writers (2 per host)
    python -m benchmarks.bench_cluster --writers 2 4 --rounds 3      # a smaller run
    python -m benchmarks.bench_cluster --help

Builds the shared-filesystem lab (``benchmarks.cluster.lab``: ``--hosts`` network namespaces mounting one
JuiceFS volume whose metadata and data live in redis across a bridge; root, FUSE, juicefs and redis needed).
For each ``--writers`` count, on a fresh pool directory of the volume, starts that many
``benchmarks.cluster.pool_worker`` processes placed round-robin over the hosts, and runs ``--rounds`` rounds
(``benchmarks.cluster.workload``): every writer puts ``--pages`` pages; then looks up ``--lookups`` chains of
other writers' pages of the round (``fresh``); the round settles (every writer sees every other's pages: the
time it took is the round's visibility lag); then ``--lookups`` chains again (``settled``). Each lookup comes
after a forced refresh that is metered (time, files opened, bytes read). Every page read is checked byte for
byte. Writes <out>/results.json, <out>/report.md (the table, with the
date, command and machine) and <out>/cluster.png; exits 1 if any page was served wrong. See
docs/benchmarks/sharing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cluster import report, workload
from benchmarks.cluster.lab import Host, Lab, unavailable
from benchmarks.common import REPO, RESULTS, args_json, make_console, timestamp, write_json
from benchmarks.machine import machine_info

console = make_console()
SETTLE_S = 60.0  # longest a round may take to become visible to every writer
POLL_S = 0.02  # the pace of polling a round's visibility


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hosts", type=int, default=4, help="lab hosts, 1..8")
    p.add_argument("--per-host", type=int, default=2, help="most writers one host runs")
    p.add_argument("--writers", type=int, nargs="+", default=[1, 2, 4, 8], help="writer counts, one run each")
    p.add_argument("--rounds", type=int, default=4, help="put-then-lookup rounds per run")
    p.add_argument("--pages", type=int, default=16, help="pages each writer puts per round")
    p.add_argument("--lookups", type=int, default=4, help="chains each writer looks up per round, fresh and "
                   "again settled")
    p.add_argument("--lookup-pages", type=int, default=8, help="pages per chain looked up")
    p.add_argument("--page-kib", type=int, default=64, help="page size in KiB (a multiple of 4)")
    p.add_argument("--heartbeat-s", type=float, default=0.5, help="the writers' lease beat")
    p.add_argument("--follow-interval-s", type=float, default=0.2, help="the pools' follow interval")
    p.add_argument("--out", type=Path, help="default benchmarks/results/cluster-<timestamp>/")
    args = p.parse_args(argv)
    problems = check(args)
    if problems:
        p.error("; ".join(problems))
    args.out = args.out or RESULTS / f"cluster-{timestamp()}"
    return args


def check(args: argparse.Namespace) -> list[str]:
    """What is wrong with ``args`` (nothing: [])."""
    problems = []
    if not 1 <= args.hosts <= 8:
        problems.append(f"--hosts must be 1..8, got {args.hosts}")
    if args.per_host < 1 or any(w < 1 for w in args.writers):
        problems.append("--per-host and --writers must be at least 1")
    elif max(args.writers) > args.hosts * args.per_host:
        problems.append(f"--writers {max(args.writers)} exceeds --hosts x --per-host = {args.hosts * args.per_host}")
    if args.rounds < 1:
        problems.append(f"--rounds must be at least 1, got {args.rounds}")
    if not 1 <= args.lookup_pages <= args.pages:
        problems.append(f"--lookup-pages must be 1..--pages ({args.pages}), got {args.lookup_pages}")
    if args.page_kib < 4 or args.page_kib % 4:
        problems.append(f"--page-kib must be a positive multiple of 4, got {args.page_kib}")
    if args.lookups < 1:
        problems.append(f"--lookups must be at least 1, got {args.lookups}")
    return problems


def pool_config(args: argparse.Namespace, writers: int) -> dict[str, Any]:
    """Every writer's store config (the pool's capacity holds every page the run puts: no eviction)."""
    slot = args.page_kib * 1024 + 4096
    return {"sharing": "cluster", "heartbeat_s": args.heartbeat_s, "follow_interval_s": args.follow_interval_s,
            "dead_after_s": max(60.0, 3 * args.heartbeat_s), "reclaim_after_s": 3600.0, "segment_bytes": 16 << 20,
            "capacity_bytes": 2 * writers * args.rounds * args.pages * slot}


class Writer:
    """A ``pool_worker`` process on a lab host."""

    def __init__(self, host: Host):
        env = {k: v for k, v in os.environ.items() if k != "KVTIER_BOOT_ID"}  # the host's own boot id counts
        env["PYTHONPATH"] = str(REPO)
        self.host = host
        self.p = host.popen(sys.executable, "-m", "benchmarks.cluster.pool_worker", stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)

    def send(self, op: str, **fields: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.p.stdin.flush()

    def recv(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"writer {self.p.pid} on {self.host.hostname} died (rc {self.p.poll()})")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"writer {self.p.pid} on {self.host.hostname}: {out['error']}: {out['message']}")
        return out

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                self.send("quit")
                self.p.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


def all_at_once(writers: list[Writer], commands: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Send each writer its command, then collect every reply: the writers run them concurrently."""
    for w, (op, fields) in zip(writers, commands):
        w.send(op, **fields)
    return [w.recv() for w in writers]


def settle(writers: list[Writer], rnd: int, pages: int) -> float:
    """Poll every writer until it sees every other writer's pages of round ``rnd``; when (monotonic)."""
    n = len(writers)
    want = [workload.others_keys(w, n, rnd, pages) for w in range(n)]
    deadline = time.monotonic() + SETTLE_S
    while True:
        seen = all_at_once(writers, [("visible", {"keys": keys}) for keys in want])
        if all(s["n"] == len(keys) for s, keys in zip(seen, want)):
            return time.monotonic()
        if time.monotonic() > deadline:
            raise RuntimeError(f"round {rnd}: not visible to every writer within {SETTLE_S:g} s")
        time.sleep(POLL_S)  # the pace of the poll: leases announce on their own clocks


def run_one(args: argparse.Namespace, lab: Lab, n: int) -> dict[str, Any]:
    """One writer count: fresh pool, ``n`` writers, the rounds; its lookups, puts and summary."""
    path = lab.mount / f"pool-{n}"
    lab.hosts[0].run("mkdir", "-p", str(path))
    where = workload.placement(n, args.hosts)
    writers = [Writer(lab.hosts[h]) for h in where]
    try:
        page_bytes, config = args.page_kib * 1024, pool_config(args, n)
        opened = all_at_once(writers, [("open", {"path": str(path), "page_bytes": page_bytes, "config": config})] * n)
        lookups: list[dict[str, Any]] = []
        puts: list[dict[str, Any]] = []
        lags: list[float] = []
        for rnd in range(args.rounds):
            puts += all_at_once(writers, [("put", {"keys": workload.round_keys(w, rnd, args.pages)})
                                          for w in range(n)])
            done = time.monotonic()
            for kind in ("fresh", "settled"):
                if kind == "settled" and n > 1:  # a writer alone has nothing to wait for
                    lags.append(settle(writers, rnd, args.pages) - done)
                replies = all_at_once(writers, [("lookups", {"chains": workload.chains(
                    w, n, rnd, args.lookups, args.pages, args.lookup_pages, kind)}) for w in range(n)])
                for w, reply in enumerate(replies):
                    lookups += [{**r, "writer": w, "round": rnd} for r in reply["lookups"]]
        stats = all_at_once(writers, [("stats", {})] * n)
    finally:
        for w in writers:
            w.stop()
    summary = report.summarize(lookups, n, len(set(where)), lags)
    console.print(report.table([summary]).splitlines()[-1])
    return {"writers": n, "placement": [lab.hosts[h].hostname for h in where],
            "wids": [o["wid"] for o in opened], "puts": puts, "lookups": lookups, "stats": stats,
            "summary": summary}


def juicefs_version(lab: Lab) -> str:
    done = subprocess.run([lab.juicefs, "version"], capture_output=True, text=True)
    return done.stdout.strip().removeprefix("juicefs version ") or "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = unavailable()
    if why is not None:
        console.print(f"[red]{why}[/]")
        return 2
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    command = "python -m benchmarks.bench_cluster " + shlex.join(sys.argv[1:] if argv is None else argv)
    info = machine_info(None, probe=False)
    load_start = os.getloadavg()[0]
    runs = []
    with Lab(args.hosts) as lab:
        version = juicefs_version(lab)
        for n in args.writers:
            runs.append(run_one(args, lab, n))
    result = {"started": started, "command": command.strip(), "machine": info, "juicefs": version,
              "args": args_json(args), "runs": runs, "summaries": [r["summary"] for r in runs],
              "loadavg": {"start": load_start, "end": os.getloadavg()[0]}}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "results.json", result)
    (args.out / "report.md").write_text(report.markdown(result))
    report.plot(result, args.out / "cluster.png")
    console.print(report.table(result["summaries"]))
    console.print(f"results: {args.out}")
    return 1 if any(s["wrong"] for s in result["summaries"]) else 0


if __name__ == "__main__":
    sys.exit(main())
