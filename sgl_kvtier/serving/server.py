"""Start, query and stop a real SGLang server: the runner shared by tests, the demo and benchmarks.

``SGLangServer`` launches ``python -m sglang.launch_server`` in its own session (process group), so stopping
it reaches the scheduler and detokenizer it spawns. Without a CUDA GPU it adds the CPU route (``CPU_ARGS``)
and ``KVTIER_CPU_SHIMS=1`` (``sgl_kvtier.sglang.plugins.cpu`` in every SGLang process); an extra config with
``"streaming": "on"`` sets ``KVTIER_STREAM=1`` (``plugin_env``: the opt-in stream plugin must be on in the
spawned scheduler before the backend reads its config). A ``model_factory`` model is served in its own
dtype unless ``extra_args`` give one. Standard library only (urllib; the GPU probe is ``nvidia-smi -L``).

On CPU, SGLang treats host RAM as device memory: by default the KV pool takes most of it and HiCache then
refuses to start, so callers bound it in ``extra_args`` (``--max-total-tokens``, ``--hicache-ratio``).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from sgl_kvtier.serving.hardware import dtype_args, has_cuda_gpu

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph")


EXTRA_CONFIG_FLAG = "--hicache-storage-backend-extra-config"
STREAM_ENV = "KVTIER_STREAM"  # sgl_kvtier.sglang.plugins: the stream plugin's switch (this module imports no adapter)


def plugin_env(kvtier_extra: Mapping[str, Any]) -> dict[str, str]:
    """The plugin switches an extra config asks for: ``streaming = "on"`` needs the stream plugin's hooks."""
    return {STREAM_ENV: "1"} if kvtier_extra.get("streaming") == "on" else {}


def extra_config_of(args: Sequence[str]) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` JSON among SGLang flags (``{}``: none, or not JSON)."""
    for flag, value in zip(args, args[1:]):
        if flag == EXTRA_CONFIG_FLAG:
            try:
                parsed = json.loads(value)
            except ValueError:
                return {}
            return parsed if isinstance(parsed, dict) else {}
    return {}


class ServerError(RuntimeError):
    """The server did not start, died, or answered a request with an error."""


# Ports this runner picks: below the kernel's ephemeral range (where bind(0) and outbound connections take
# theirs, so a client's connection could take a bind(0) port before the server binds it) and below SGLang's
# own picks (22000-29999, `get_free_port_below_ephemeral`), with room above for the ports SGLang derives
# from `--port` under DP attention (port + 233 .. + 240).
PORT_RANGE = range(10000, 21700)
ADDRESS_IN_USE = re.compile(r"address already in use|Errno 98", re.IGNORECASE)
START_ATTEMPTS = 3  # start-ups on a fresh port when the picked one was taken meanwhile
_PICK = random.SystemRandom()  # not the random module's state: a test that seeds it must not align two workers' picks


def free_port() -> int:
    """A TCP port of ``PORT_RANGE`` that was free on 127.0.0.1 a moment ago (the OS picks one where 64 tries
    found none)."""
    for port in _PICK.sample(PORT_RANGE, 64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, max_bytes: int = 6000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"


# ``stop`` SIGTERMs the whole group, so SGLang's launcher sees its detokenizer die and takes its crash path,
# which sleeps before py-spy / CUDA core dumps. A runner's stop is no crash: those dumps are off unless the
# caller's environment asks for them.
NO_CRASH_DUMPS = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "false", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "false"}


class SGLangServer:
    """Context manager around one `sglang.launch_server` process group.

    `extra_args` are appended verbatim after the runner's own flags; `env` entries override the
    inherited environment. `command` is the exact argv, for reports.
    """

    def __init__(
        self,
        model_path: Path | str,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: Path | str | None = None,
        *,
        startup_timeout_s: float = 300.0,
        stop_grace_s: float = 20.0,
        cpu: bool | None = None,
        admin_api_key: str | None = None,
    ) -> None:
        self._own_port = port is None  # a port this runner picked may be picked again (``start``)
        self.port = port if port is not None else free_port()
        # Sent with every request unless a call passes its own headers (SGLang's admin endpoints need it).
        self.auth = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
        self.url = f"http://127.0.0.1:{self.port}"
        self.cpu = (not has_cuda_gpu()) if cpu is None else cpu
        self.command: list[str] = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(model_path),
            "--host", "127.0.0.1", "--port", str(self.port),
            *(CPU_ARGS if self.cpu else ()),
            *dtype_args(model_path, extra_args),  # a factory model's own dtype, unless extra_args set one
            *extra_args,
            *(("--admin-api-key", admin_api_key) if admin_api_key else ()),
        ]  # fmt: skip
        self.env: dict[str, str] = {**NO_CRASH_DUMPS, **os.environ}
        if self.cpu:
            self.env["KVTIER_CPU_SHIMS"] = "1"
        self.env.update(plugin_env(extra_config_of(extra_args)))
        self.env.update(env or {})
        if log_path is None:
            log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-{self.port}.log"
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self.gc_frozen: bool | None = None  # whether ``/freeze_gc`` answered 200 after start-up (``_freeze_gc``)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> SGLangServer:
        """Launch the server and wait until ``/health`` answers 200 (or raise ``ServerError`` with the log tail).
        A start-up that fails because its port was taken meanwhile, on a port this runner picked, is tried
        again on a fresh one (``START_ATTEMPTS`` in all)."""
        if self.proc is not None:
            raise ServerError("server already started")
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return self._start_once()
            except ServerError:
                if not (self._own_port and attempt < START_ATTEMPTS and self._port_was_taken()):
                    raise
            self.proc = None
            self._move_to(free_port())
        raise AssertionError("unreachable")

    def _port_was_taken(self) -> bool:
        exited = self.proc is not None and self.proc.poll() is not None
        return exited and bool(ADDRESS_IN_USE.search(_tail(self.log_path)))

    def _move_to(self, port: int) -> None:
        i = self.command.index("--port")
        self.command[i + 1] = str(port)
        self.port, self.url = port, f"http://127.0.0.1:{port}"

    def _start_once(self) -> SGLangServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with self.log_path.open("wb") as log:
            # The child keeps its own copy of the descriptor; ours can close right away.
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        try:
            self._wait_healthy(t0 + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self.gc_frozen = self._freeze_gc()
        return self

    def _freeze_gc(self) -> bool:
        """POST ``/freeze_gc`` (every SGLang process moves its start-up objects out of the collector's reach);
        whether it answered 200. SGLang posts it itself after its warm-up request
        (``http_server._freeze_gc_after_server_warmup``), but with ``--skip-server-warmup`` it may post before its
        HTTP server listens and fail, leaving the start-up objects in the collected heap, where each full
        collection holds the GIL in the middle of a request. Sent again so every server this runner starts is in
        the state SGLang means after start-up. A refusal is returned, never raised (the server still serves)."""
        try:
            status, _ = self.request("POST", "/freeze_gc", None, timeout_s=30.0)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False
        return status == 200

    def _wait_healthy(self, deadline: float) -> None:
        assert self.proc is not None
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(
                    f"SGLang server exited with code {code} during start-up.\n"
                    f"command: {' '.join(self.command)}\nlog tail ({self.log_path}):\n{_tail(self.log_path)}"
                )
            status = self._status("/health")
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise ServerError(
                    f"SGLang server not healthy after {self.startup_timeout_s:.0f} s (last /health: {status}).\n"
                    f"log tail ({self.log_path}):\n{_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def _status(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None

    def stop(self) -> int | None:
        """SIGTERM the process group, SIGKILL it after the grace period; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                proc.wait(timeout=30)
        # The launcher may exit before its children do; sweep what is left of the group.
        self._signal_group(signal.SIGKILL)
        return proc.returncode

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- requests ----------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, timeout_s: float = 600.0,
                headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        """Any HTTP call on the server; (status, body). Errors are returned, not raised.

        ``headers`` replaces the default ones (``self.auth``): pass ``{}`` to call without credentials.
        """
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers=dict(self.auth if headers is None else headers))
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read()

    def generate(
        self,
        text: str | None = None,
        input_ids: Sequence[int] | None = None,
        max_new_tokens: int = 8,
        temperature: float = 0.0,
        timeout_s: float = 600.0,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> dict[str, Any]:
        """POST /generate with one prompt; returns SGLang's JSON (`text`, `output_ids`, `meta_info`).

        `cache_salt` seeds SGLang's prefix-hash chain: requests with different salts share no cache.
        """
        if (text is None) == (input_ids is None):
            raise ValueError("pass exactly one of text and input_ids")
        body: dict[str, Any] = {
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature, **sampling}
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if text is not None:
            body["text"] = text
        else:
            body["input_ids"] = list(input_ids or ())
        status, raw = self.request("POST", "/generate", body, timeout_s)
        if status != 200:
            raise ServerError(f"/generate answered {status}: {raw[:500]!r}")
        out: dict[str, Any] = json.loads(raw)
        return out

    def flush_cache(self, timeout_s: float = 60.0) -> float:
        """POST /flush_cache (drops L1 and L2, keeps L3); returns seconds spent.

        The scheduler refuses (400) while it is not idle, e.g. with work still in flight after a
        request; retry until it accepts or the deadline passes.
        """
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            status, raw = self.request("POST", "/flush_cache", None, timeout_s=30.0)
            if status == 200:
                return time.monotonic() - t0
            if status != 400 or time.monotonic() > deadline:
                raise ServerError(f"/flush_cache answered {status}: {raw[:300]!r}")
            time.sleep(0.2)

    def metric(self, name: str) -> float:
        """Sum of every sample of Prometheus metric `name` on /metrics (0.0 if absent).

        Needs `--enable-metrics`. Labels are summed over, e.g. all TP ranks.
        """
        status, raw = self.request("GET", "/metrics", None, timeout_s=30.0)
        if status != 200:
            raise ServerError(f"/metrics answered {status}; was the server started with --enable-metrics?")
        total = 0.0
        for line in raw.decode("utf-8", errors="replace").splitlines():
            match = _SAMPLE.match(line)
            if match and match.group(1) == name:
                total += float(match.group(3))
        return total

    def wait_metric(self, name: str, at_least: float, timeout_s: float = 60.0) -> float:
        """Poll `metric(name)` until it reaches `at_least`; returns the value seen.

        E.g. `sglang:backuped_tokens_total` to know that L3 writes have landed before a flush.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.metric(name)
            if value >= at_least:
                return value
            if time.monotonic() > deadline:
                raise ServerError(f"{name} reached only {value} (wanted >= {at_least}) within {timeout_s:.0f} s")
            time.sleep(0.2)


def cached_tiers(out: dict[str, Any]) -> dict[str, int]:
    """Where a /generate answer's cached tokens came from: SGLang's ``cached_tokens_details`` (needs
    ``--enable-cache-report``) as ``device`` / ``host`` / ``storage`` counts, 0 for a tier it omits."""
    details = out["meta_info"].get("cached_tokens_details") or {}
    return {tier: int(details.get(tier, 0)) for tier in ("device", "host", "storage")}


def tracebacks_through(log: str, package: str = "sgl_kvtier") -> list[str]:
    """Tracebacks in a server log with a frame in ``package`` (SGLang logs harmless ones of its own on CPU)."""
    blocks = log.split("Traceback (most recent call last):")[1:]
    return [b[:3000] for b in blocks
            if any(line.lstrip().startswith('File "') and f"/{package}/" in line for line in b.splitlines())]
