"""The servers of one bench_streaming device, and the schedule that runs their rounds.

``BenchServer`` is one real ``sglang.launch_server`` (HiCache + sgl-kvtier L3, its own fresh L3 directory,
``streaming`` set in the L3 config): ``start``, then ``serve`` its rounds one at a time (each L3 round after
``settle``: write-back drained, L1 + L2 flushed, page cache dropped), then ``finish`` (per-level summaries,
stop, the store's summary, the log's counts; the L3 directory removed unless kept).

Schedules (``--schedule``), for the servers of one device (``off`` and ``on``):

- ``interleaved`` (default): the servers are up at once and serve round i one after the other, the first
  alternating with i (``off`` first at even i, ``on`` first at odd i); after its round a server's own L3
  write-back is waited for, so the peer is quiet while the other measures (its CPU seconds during each
  phase are recorded as ``peer_cpu_s``). A shared machine's drift (up to 25% between servers measured
  minutes apart) then hits both modes alike, round by round, and each measured round
  is one paired on/off comparison (``streaming.paired``). With ``--twin`` a third server (a second ``off``
  or ``on``, with ``--twin-env`` over the environment) takes its turn too: the order rotates with i, so
  each server takes each turn alike (a fixed or reversing order would leave one server always in the middle
  turn, right after another server's round).
- ``sequential``: one server at a time, each serving all its rounds.

Every server runs with ``--sleep-on-idle``: an idle SGLang scheduler otherwise polls its sockets in a busy
loop (measured on a 2-vCPU VM, kvheavy: 1.02 CPU-s/s idle, 0.03 with the flag), which would take a
core from the peer's measurement. The flag changes nothing while a request is queued or running.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import shlex
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.serving import configs, session
from benchmarks.serving.policies import DeviceSetting, Round, unique_tokens
from benchmarks.serving.probes import cpu_seconds, store_summary, thread_cpu
from benchmarks.serving.settle import settle, wait_l3
from benchmarks.streaming import counters, plan, rounds
from sgl_kvtier.serving import client, summary

KVTIER = configs.CONFIGS["e"]  # HiCache + sgl-kvtier L3: the server every cell runs
IDLE_FLAG = "--sleep-on-idle"


class Schedule(str, enum.Enum):
    INTERLEAVED = "interleaved"
    SEQUENTIAL = "sequential"

    def __str__(self) -> str:
        return self.value


def batches(schedule: Schedule, group: Sequence[Any]) -> list[list[Any]]:
    """The servers of one device that are up together: all of them (interleaved) or one at a time."""
    return [list(group)] if schedule is Schedule.INTERLEAVED else [[s] for s in group]


def order(servers: Sequence[Any], i: int) -> list[Any]:
    """Who serves round ``i`` in which turn: the servers' order rotated by ``i`` (two servers: in their
    order at even i, reversed at odd i; three: each takes each turn once every three rounds)."""
    k = i % len(servers) if servers else 0
    return [*servers[k:], *servers[:k]]


class BenchServer:
    """One server of the run (module docstring). ``res`` is its record in ``results.json``."""

    def __init__(self, args: argparse.Namespace, spec: plan.ServerRun, device: DeviceSetting,
                 base_plan: configs.ServerPlan, model_dir: Path, server_rounds: list[Round], drop: bool,
                 kvbpt: int) -> None:
        from sgl_kvtier.serving.server import SGLangServer

        self.args, self.spec, self.rounds, self.drop, self.kvbpt = args, spec, server_rounds, drop, kvbpt
        self.tag = f"{device.name}-{spec.key}"
        extra = plan.server_extra(device, args.kvtier_extra, spec.streaming)
        idle = () if IDLE_FLAG in base_plan.extra_args else (IDLE_FLAG,)
        splan = dataclasses.replace(base_plan, l3_root=base_plan.l3_root / self.tag, kvtier_extra=extra,
                                    extra_args=("--hicache-storage-prefetch-policy", args.prefetch_policy, *idle,
                                                *base_plan.extra_args))
        self.l3 = KVTIER.l3_dir(splan)
        env = {**args.env, **(args.twin_env if spec.twin else {})}  # --twin-env: the twin's alone
        self.srv = SGLangServer(model_dir, extra_args=KVTIER.args(splan), env=env,
                                log_path=args.out / "logs" / f"{self.tag}.log", cpu=not splan.gpu,
                                startup_timeout_s=args.startup_timeout)
        self.res: dict[str, Any] = {
            "command": self.srv.command, "command_str": shlex.join(self.srv.command), "env": env,
            "log": str(self.srv.log_path), "references": spec.references, "rounds": [], "levels": {}}
        self.unique = unique_tokens(server_rounds, splan.page_size)
        self.base = 0.0
        self.started = False

    @property
    def failed(self) -> bool:
        return "error" in self.res

    def start(self) -> None:
        shutil.rmtree(self.l3, ignore_errors=True)
        self.l3.mkdir(parents=True, mode=0o700)
        self.started = True
        self.srv.start()
        self.res["startup_s"], self.res["gc_frozen"] = self.srv.startup_s, self.srv.gc_frozen
        self.base = client.counters(client.scrape(self.srv.url))["backuped_tokens"]

    def serve(self, i: int, console: Any, on_request: Any, peers: Sequence[BenchServer] = ()) -> None:
        """Round ``i``; with ``peers`` up, the peers' CPU seconds during the phase are recorded and this
        server's write-back is drained afterwards (module docstring)."""
        rnd, srv = self.rounds[i], self.srv
        pre = settle(self.args, srv, self.unique, i, self.base, self.drop, console) \
            if i and rounds.settles(rnd.kind) else {}
        before = counters.read(client.scrape(srv.url))
        started = time.time()
        peer0 = [p.cpu_s() for p in peers]
        assert srv.proc is not None, "not started"
        threads0 = thread_cpu(srv.proc.pid)
        m = session.measure_phase(srv, rnd.requests, rnd.concurrency, on_request)
        threads = {k: round(v - threads0.get(k, 0.0), 4) for k, v in thread_cpu(srv.proc.pid).items()}
        peer = [round(p.cpu_s() - c0, 2) for p, c0 in zip(peers, peer0)]
        after = client.scrape(srv.url)
        moved = counters.delta(counters.read(after), before)
        rec = {"index": i, "kind": rnd.kind, "concurrency": rnd.concurrency, "measured": rnd.kind in rounds.LEVEL_OF,
               "started": started, "settle": pre, "stream_counters": moved, "bind": counters.bind(after),
               "thread_cpu_s": {k: v for k, v in threads.items() if v > 0}, **m}
        if peers:
            rec["peer_cpu_s"] = peer
            rec["drained"] = wait_l3(srv.url, self.base + self.unique[i], self.args.backup_wait, self.args.backup_stall)
        self.res["rounds"].append(rec)

    def cpu_s(self) -> float:
        """CPU seconds the server's processes have used so far."""
        assert self.srv.proc is not None, "not started"
        return cpu_seconds(self.srv.proc.pid)["server_s"]

    def fail(self, console: Any, exc: Exception) -> None:
        self.res["error"] = session.failure(console, self.tag, exc)

    def finish(self, console: Any) -> None:
        """Summaries per level (none for a failed server), stop, store summary, log counts, L3 removed."""
        try:
            if not self.failed:
                self._summarize(console)
        finally:
            self.res["exit_code"] = self.srv.stop() if self.started else None
            if self.started:
                self.res["l3_store"] = store_summary(KVTIER, self.l3)
                self.res["log_counts"] = counters.log_counts(self.srv.log_path.read_text(errors="replace"))
            if not self.args.keep_l3:
                shutil.rmtree(self.l3, ignore_errors=True)

    def _summarize(self, console: Any) -> None:
        done = self.res["rounds"]
        for kind, level in rounds.LEVEL_OF.items():
            for c in sorted({r["concurrency"] for r in done if r["kind"] == kind}):
                phases = [r for r in done if r["kind"] == kind and r["concurrency"] == c]
                s = summary.summarize(phases, self.kvbpt) | {"stream": counters.total(phases),
                                                             "bind": phases[-1].get("bind", {}),
                                                             "thread_cpu_s": counters.total(phases, "thread_cpu_s")}
                self.res["levels"].setdefault(level, {})[str(c)] = s
                console.log(f"{self.tag:28s} {level:9s} C={c}: TTFT p50 {s['ttft_p50_s']:.2f} s p99 "
                            f"{s['ttft_p99_s']:.2f} s, L3 tokens {s['cached_tokens']['storage']} of "
                            f"{s['prompt_tokens']}, {s['errors']} errors")


def run_batch(servers: Sequence[BenchServer], console: Any, bars: Any, task: Any) -> None:
    """Start ``servers``, serve their rounds in lockstep (``order``), finish each. A server that fails is
    recorded as failed (``res["error"]``) and the others go on."""
    try:
        for s in servers:
            bars.update(task, description=f"{s.tag}: starting server")
            try:
                s.start()
            except Exception as exc:  # noqa: BLE001 - one broken server must not lose the others
                s.fail(console, exc)
        for i in range(max(len(s.rounds) for s in servers)):
            for s in order(servers, i):
                if s.failed or i >= len(s.rounds):
                    continue
                rnd = s.rounds[i]
                bars.update(task, description=f"{s.tag}: {rnd.kind} round {i} (C={rnd.concurrency})")
                peers = [p for p in servers if p is not s and not p.failed]
                try:
                    s.serve(i, console, lambda _r: bars.advance(task), peers)
                except Exception as exc:  # noqa: BLE001 - as above
                    s.fail(console, exc)
    finally:
        for s in servers:
            s.finish(console)
