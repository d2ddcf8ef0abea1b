"""What every system of ``bench_peers`` is: its SGLang flags and environment, the services it runs beside the
server, the packages it needs, the DRAM it keeps outside SGLang's pools, and the versions it records.

A system that cannot run here raises ``Skip`` (from ``prepare``) with the reason; the run records it and goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.peers.cgroup import MemoryCgroup
from benchmarks.peers.venv import PeersVenv
from benchmarks.serving.configs import ServerPlan

NONE, DRAM, FLASH = "none", "dram", "flash"  # where a system keeps what it serves from storage


class Skip(Exception):
    """This system cannot run here; the message says why."""


@dataclasses.dataclass
class Context:
    """What a system's set-up needs: the shared server plan, a directory of its own (its store lives there), the
    peers venv, the model's KV bytes per token and the host-pool size in bytes; the loopback ports its services
    listen on (``port``)."""

    plan: ServerPlan
    work: Path
    venv: PeersVenv
    kv_bytes_per_token: int
    host_pool_bytes: int
    working_set_bytes: int
    log_dir: Path
    run_id: str
    ports: dict[str, int] = dataclasses.field(default_factory=dict)

    def port(self, name: str, derived: tuple[int, ...] = ()) -> int:
        """The loopback port of ``name`` (a service's listener), picked free the first time it is asked for and
        the same after, so a service's command and the server's flags agree; with ``derived``, one whose
        ``port + offset`` is free for each offset too (a service that opens more ports at fixed offsets)."""
        from sgl_kvtier.serving.server import free_port

        if name not in self.ports:
            for _ in range(64):
                port = free_port()
                taken = set(self.ports.values())
                if port not in taken and all(bindable(port + d) and port + d not in taken for d in derived):
                    self.ports[name] = port
                    break
            else:
                raise Skip(f"no free port for {name} (with {', '.join(f'+{d}' for d in derived)} free too)")
        return self.ports[name]


def bindable(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def tcp_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return 200 <= int(resp.status) < 500
    except urllib.error.HTTPError as exc:
        return int(exc.code) < 500
    except (urllib.error.URLError, OSError):
        return False


class Service:
    """One process a system runs beside its server (Mooncake's master, LMCache's daemon, SeaweedFS): started in
    its own session inside the system's cgroup, ready when ``ready()`` is true, stopped by signalling its group."""

    def __init__(self, name: str, command: list[str], log: Path, ready: Callable[[], bool],
                 env: Mapping[str, str] | None = None, cwd: Path | None = None, timeout_s: float = 120.0) -> None:
        self.name, self.command, self.log, self.ready = name, command, log, ready
        self.env = {**os.environ, **(env or {})}
        self.cwd, self.timeout_s = cwd, timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def start(self, cgroup: MemoryCgroup | None) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = cgroup.wrap(self.command) if cgroup is not None else self.command
        t0 = time.monotonic()
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, cwd=self.cwd, start_new_session=True)
        while not self.ready():
            if self.proc.poll() is not None:
                raise Skip(f"{self.name} exited with code {self.proc.returncode} at start-up: {tail(self.log)}")
            if time.monotonic() - t0 > self.timeout_s:
                raise Skip(f"{self.name} not ready after {self.timeout_s:.0f} s: {tail(self.log)}")
            time.sleep(0.5)
        self.startup_s = round(time.monotonic() - t0, 2)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM its process group, SIGKILL it after ``grace_s``; then SIGKILL what is left of the group (a
        launcher may exit before what it started does). Its exit code."""
        proc = self.proc
        if proc is None:
            return None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.poll()

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "command": self.command, "log": str(self.log), "startup_s": self.startup_s,
                "exit_code": self.proc.poll() if self.proc is not None else None}


def tail(path: Path, n: int = 600) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return " ".join(text[-n:].split())


class System:
    """One row of the benchmark. Subclasses set the class attributes and override what they need."""

    name = ""
    summary = ""
    storage = NONE  # NONE (no L3), DRAM or FLASH: where its L3 data lives
    packages: tuple[str, ...] = ()  # distributions it needs in the peers venv, each pinned in constraints.txt
    modules: tuple[str, ...] = ()  # modules that must import on the peers venv's interpreter
    tools: tuple[str, ...] = ()  # executables its packages put in the peers venv's bin (its services)
    upstream = ""  # where its documentation is
    hicache = True  # whether it runs HiCache (a host pool of --hicache-ratio x the device pool)
    l3 = True  # whether the harness waits for L3 write-back between phases (SGLang's HiCache backup counter)
    flush = True  # whether /flush_cache between phases means anything (not for recompute)

    @property
    def needs_venv(self) -> bool:
        return bool(self.packages)

    def python(self, ctx: Context) -> str | None:
        """The interpreter its server runs on: the peers venv's when it needs packages, else the project's (None)."""
        return str(ctx.venv.python) if self.needs_venv else None

    def prepare(self, ctx: Context, install: bool) -> None:
        """Check (and with ``install``, install) what it needs; raise ``Skip`` with the reason when it cannot run."""
        missing = ctx.venv.missing(self.packages) if self.packages else []
        if missing and not install:
            raise Skip(f"not installed in {ctx.venv.path.name}: {', '.join(missing)} (run with --install)")
        if missing:
            why = ctx.venv.install(tuple(missing))
            if why:
                raise Skip(why)
            still = ctx.venv.missing(self.packages)
            if still:
                raise Skip(f"still missing after install: {', '.join(still)}")
        if self.modules and (why := ctx.venv.import_check(self.modules)):
            raise Skip(why)
        absent = [t for t in self.tools if not (ctx.venv.bin / t).exists()]
        if absent:
            raise Skip(f"{', '.join(absent)} not found in {ctx.venv.bin}")

    def services(self, ctx: Context) -> list[Service]:
        return []

    def server_args(self, ctx: Context) -> list[str]:
        raise NotImplementedError

    def server_env(self, ctx: Context) -> dict[str, str]:
        return {}

    def dram_store_bytes(self, ctx: Context) -> int:
        """DRAM the system is configured to keep outside SGLang's device and host pools (reported)."""
        return 0

    def readings(self, ctx: Context) -> dict[str, float]:
        """What the system itself reports of its store, read before and after every phase beside the cgroup's
        (Mooncake: the bytes its DRAM pool holds); empty where it reports nothing."""
        return {}

    def versions(self, ctx: Context) -> dict[str, str]:
        """SGLang's version and each of its packages' (as installed in the peers venv or the project's)."""
        return {"sglang": metadata.version("sglang")} | ctx.venv.versions(self.packages)

    def describe(self) -> dict[str, Any]:
        return {"summary": self.summary, "storage": self.storage, "packages": list(self.packages),
                "upstream": self.upstream}
