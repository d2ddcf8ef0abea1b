"""The front of several SGLang instances: SGLang's own router (``sglang_router.launch_router``,
``--policy round_robin``) as a process of its own, or, where it cannot run, a round-robin client; and a
phase of requests sent through either.

The router runs in its own session (process group) with retries, the circuit breaker and worker health
checks off: a benchmark wants each request on the instance round-robin picked, once, not re-routed
because a 1-core instance answered ``/health`` slowly while computing. Its Prometheus endpoint (per-worker
outcome counters) is scraped at the end of a configuration.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.serving.workloads import Request
from sgl_kvtier.serving import client


def router_command(worker_urls: list[str], port: int, prometheus_port: int, policy: str = "round_robin",
                   extra: list[str] | None = None) -> list[str]:
    """The router's argv: ``worker_urls`` behind ``127.0.0.1:port`` with ``policy``."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--disable-retries", "--disable-circuit-breaker", "--disable-health-check",
            "--request-timeout-secs", "1800", "--shutdown-grace-period-secs", "5", "--log-level", "warn",
            *(extra or [])]  # fmt: skip


def _get(url: str, timeout_s: float = 5.0) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""
    except (urllib.error.URLError, OSError):
        return None, b""


class RouterProcess:
    """One ``sglang_router.launch_router`` process group: start, wait until both workers are listed, stop."""

    def __init__(self, worker_urls: list[str], port: int, prometheus_port: int, log_path: Path,
                 policy: str = "round_robin", extra: list[str] | None = None, startup_timeout_s: float = 120.0) -> None:
        self.workers = list(worker_urls)
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{prometheus_port}/metrics"
        self.command = router_command(worker_urls, port, prometheus_port, policy, extra)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def start(self) -> RouterProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"router exited with code {self.proc.returncode} during start-up: "
                                       f"{self.log_path.read_text(errors='replace')[-2000:]}")
                if self.ready():
                    break
                if time.monotonic() - t0 > self.startup_timeout_s:
                    raise RuntimeError(f"router not ready after {self.startup_timeout_s:.0f} s")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def ready(self) -> bool:
        """Whether the router answers ``/readiness`` and lists every worker in ``/workers``."""
        status, _ = _get(self.url + "/readiness")
        if status != 200:
            return False
        status, body = _get(self.url + "/workers")
        try:
            listed = {w.get("url") for w in json.loads(body).get("workers", [])} if status == 200 else set()
        except ValueError:
            return False
        return set(self.workers) <= listed

    def worker_counts(self) -> dict[str, float]:
        """Requests the router sent to each worker so far (``smg_worker_cb_outcomes_total`` by worker)."""
        out: dict[str, float] = {}
        for name, labels, value in client.scrape(self.metrics_url.removesuffix("/metrics")):
            if name == "smg_worker_cb_outcomes_total" and "worker" in labels:
                out[labels["worker"]] = out.get(labels["worker"], 0.0) + value
        return out

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            _killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        _killpg(proc.pid, signal.SIGKILL)
        return proc.returncode

    def record(self) -> dict[str, Any]:
        return {"command": self.command, "command_str": shlex.join(self.command), "log": str(self.log_path),
                "startup_s": self.startup_s}


def _killpg(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


class Frontend:
    """Where each request goes: always the router's URL, or (``router is None``) the instances in turn."""

    def __init__(self, worker_urls: list[str], router: RouterProcess | None = None, reason: str | None = None) -> None:
        self.workers = list(worker_urls)
        self.router = router
        self.reason = reason
        self._next = 0
        self._lock = threading.Lock()

    @property
    def kind(self) -> str:
        return "router" if self.router is not None else "client-round-robin"

    def target(self) -> tuple[str, int | None]:
        """(URL, instance index when the client picked it itself) for the next request."""
        if self.router is not None:
            return self.router.url, None
        with self._lock:
            i = self._next % len(self.workers)
            self._next += 1
        return self.workers[i], i

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "workers": self.workers, "reason": self.reason}
        if self.router is not None:
            out["router"] = self.router.record()
        return out


def run_phase(front: Frontend, requests: list[Request], concurrency: int, tag: str, gap_s: float = 0.0,
              on_done: Callable[[dict[str, Any]], None] | None = None) -> tuple[list[dict[str, Any]], float]:
    """Send ``requests`` through ``front`` in order, at most ``concurrency`` in flight and at least ``gap_s``
    apart (so they reach the router in the order round-robin is predicted on); (records, wall seconds).
    Each request carries the rid ``<tag>-<request rid>`` (``sent_rid`` in its record)."""
    slots = threading.Semaphore(concurrency)
    records: list[dict[str, Any] | None] = [None] * len(requests)

    def one(i: int, req: Request, url: str, instance: int | None) -> None:
        try:
            rid = f"{tag}-{req.rid}"
            rec = client.stream_generate(url, req, rid=rid)
            rec.update(sent_rid=rid, via_instance=instance)
            records[i] = rec
            if on_done is not None:
                on_done(rec)
        finally:
            slots.release()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for i, req in enumerate(requests):
            slots.acquire()
            url, instance = front.target()
            pool.submit(one, i, req, url, instance)
            if gap_s > 0:
                time.sleep(gap_s)  # dispatch order = arrival order at the router
    wall = time.perf_counter() - t0
    return [r if r is not None else {"rid": requests[i].rid, "group": requests[i].group, "error": "lost"}
            for i, r in enumerate(records)], wall
