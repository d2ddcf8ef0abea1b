"""The arms of a verification: what each serves the prompts from.

An arm is an ``Offload`` level (``l3``, ``l2-only``, ``hbm-only``) and either the endpoints of a deployment
that is already running (``--endpoint l3=URL[,URL...]``; the operator's own servers, or a router) or nothing,
in which case ``serve`` starts one SGLang server from the ``launch`` config with that level's tiers, plays
on it and stops it. Started servers run one at a time, so two arms never share the machine.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_kvtier.errors import ConfigError
from sgl_kvtier.serving.launch import Offload, make_directory_devices, sglang_args
from sgl_kvtier.serving.server import SGLangServer


@dataclass(frozen=True)
class Arm:
    """One arm: its level, and the running endpoints it uses (none: a server started from the config)."""

    offload: Offload
    urls: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.offload.value

    @property
    def started(self) -> bool:
        return not self.urls


def parse_endpoint(text: str) -> Arm:
    """``ARM=URL[,URL...]`` (``l3=http://10.0.0.5:30000``) as an ``Arm``; a bad one is a ``ConfigError``."""
    name, sep, urls = text.partition("=")
    levels = [o.value for o in Offload]
    if not sep or name not in levels:
        raise ConfigError("--endpoint", f"expected ARM=URL[,URL...] with ARM one of {', '.join(levels)}, got {text!r}")
    parsed = tuple(u.strip().rstrip("/") for u in urls.split(",") if u.strip())
    bad = [u for u in parsed if not u.startswith(("http://", "https://"))]
    if not parsed or bad:
        raise ConfigError("--endpoint", f"{name}: URLs must start with http:// or https://, got {urls!r}")
    return Arm(Offload(name), parsed)


def get_json(url: str, path: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """GET ``url + path`` as JSON; None when it fails (the caller says what it falls back to)."""
    try:
        with urllib.request.urlopen(url + path, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def post(url: str, path: str, timeout_s: float = 120.0) -> int | None:
    """POST with an empty body; the status (None: unreachable)."""
    req = urllib.request.Request(url + path, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


def healthy(url: str, timeout_s: float = 10.0) -> bool:
    """Whether ``url`` answers ``GET /health`` with 200."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def model_path_of(url: str) -> str | None:
    """The model path a running SGLang server reports (``/model_info``)."""
    info = get_json(url, "/model_info")
    path = None if info is None else info.get("model_path")
    return path if isinstance(path, str) else None


@dataclass(frozen=True)
class Serving:
    """Where an arm is served now: its endpoints, and for a started server its command and log."""

    urls: tuple[str, ...]
    command: tuple[str, ...] = ()
    log: str = ""
    startup_s: float | None = None


def config_model(doc: dict[str, Any], gpu: bool) -> Path:
    """The model directory a ``launch`` config serves (a factory model is made now)."""
    model, _, _ = sglang_args(doc, gpu)
    return Path(model)


@contextmanager
def serve(arm: Arm, doc: dict[str, Any] | None, *, gpu: bool, log_dir: Path, startup_timeout_s: float,
          extra_args: tuple[str, ...] = ()) -> Iterator[Serving]:
    """The arm's endpoints while the block runs: the running ones, or a server started from ``doc`` at the
    arm's level (stopped on the way out, also on failure)."""
    if not arm.started:
        down = [u for u in arm.urls if not healthy(u)]
        if down:
            raise ConfigError("--endpoint", f"{arm.name}: {', '.join(down)} does not answer GET /health with 200")
        yield Serving(arm.urls)
        return
    if doc is None:
        raise ConfigError("--config", f"arm {arm.name} has no --endpoint, so it needs a config to start from")
    if arm.offload is Offload.L3:
        make_directory_devices(doc)
    model, args, env = sglang_args(doc, gpu, offload=arm.offload)
    log = log_dir / f"{arm.name}.log"
    srv = SGLangServer(model, extra_args=[*args, *extra_args], env=env, log_path=log, cpu=not gpu,
                       startup_timeout_s=startup_timeout_s)
    try:
        srv.start()
        yield Serving((srv.url,), tuple(srv.command), str(log), srv.startup_s)
    finally:
        srv.stop()
