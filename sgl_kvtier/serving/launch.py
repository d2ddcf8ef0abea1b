"""``sgl-kvtier launch --config X.toml [--print] [-- extra sglang args]``: one command for an SGLang server
with sgl-kvtier as its L3 tier.

Config file (TOML), two tables:
    [sglang]  flags for ``python -m sglang.launch_server`` (``key = value``: ``--key-with-dashes value``;
              ``true``: a bare flag; a list: the values after one flag). ``model_path`` may be ``"tiny"`` /
              ``"bench"`` / ``"kvheavy"``: a factory model in the machine's native dtype, served with it.
    [kvtier]  store keys, validated before SGLang starts and passed in the extra config; except
              ``prefetch_policy = "cost" | "off"``, set as ``KVTIER_PREFETCH_POLICY`` in the server's
              environment (absent: left as it is); ``streaming = "on"`` also sets ``KVTIER_STREAM=1``.
HiCache flags and our backend (``interface_v1``, prefix keys passed) are always set; without a GPU, the CPU
flags and ``KVTIER_CPU_SHIMS=1`` too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tomllib
from enum import Enum
from pathlib import Path
from typing import Any

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import ConfigError
from sgl_kvtier.policy.cost_inputs import ENV_POLICY
from sgl_kvtier.serving.hardware import AUTO, DtypeChoice, choose_dtype, has_cuda_gpu
from sgl_kvtier.serving.server import CPU_ARGS, plugin_env

BACKEND = {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang", "class_name": "KVTierStorage",
           "interface_v1": 1, "hicache_storage_pass_prefix_keys": True}
SGLANG_EXTRA_KEYS = ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token")
MODEL_SIZES = ("tiny", "bench", "kvheavy")
PREFETCH_POLICIES = ("cost", "off")


class Offload(Enum):
    """How much of a config's KV hierarchy a server runs: all of it, or less (a baseline to compare with)."""

    L3 = "l3"  # HiCache's host tier and sgl-kvtier: the config as written
    L2_ONLY = "l2-only"  # HiCache's host tier, no L3: [kvtier] and the L3 prefetch keys left out
    HBM_ONLY = "hbm-only"  # no HiCache: the radix cache in HBM; whatever it lacks is recomputed


def load(path: str | Path) -> dict[str, Any]:
    """The TOML config at ``path``; a table other than [sglang] / [kvtier] is a ``ConfigError``."""
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    unknown = sorted(set(doc) - {"sglang", "kvtier"})
    if unknown:
        raise ConfigError(unknown[0], f"unknown table in {path}; expected [sglang] and [kvtier]")
    return doc


def model_cache_dir() -> Path:
    """Where random models are made (``KVTIER_MODEL_CACHE``, default ``~/.cache/sgl-kvtier/models``)."""
    return Path(os.environ.get("KVTIER_MODEL_CACHE", Path.home() / ".cache" / "sgl-kvtier" / "models"))


def factory_model(size: str, dtype: str | None = AUTO, *, gpu: bool | None = None, make: bool = True,
                  source: str = "--dtype") -> tuple[Path, DtypeChoice]:
    """The random model of ``size`` in the model cache, in ``choose_dtype(dtype, gpu=gpu)``'s dtype (made now
    if ``make``), and that choice. One directory per size and dtype (``tiny-float32``, ...), so models of two
    dtypes never share one. ``source`` names where an explicit ``dtype`` came from (for the record)."""
    choice = choose_dtype(dtype, gpu=gpu, source=source)
    path = model_cache_dir() / f"{size}-{choice.dtype}"
    if make:
        from sgl_kvtier.serving.model_factory import make_model

        make_model(path, size=size, dtype=choice.dtype)
    return path, choice


def extra_config(kvtier: dict[str, Any], sglang_extra: dict[str, Any]) -> dict[str, Any]:
    """The extra-config JSON: our backend, SGLang's prefetch keys and the validated [kvtier] keys."""
    StoreConfig.from_mapping(kvtier)  # fail here, naming the field, not deep inside SGLang's scheduler
    kvtier = dict(kvtier)
    # The server may run elsewhere than here: relative paths are made absolute against this directory.
    if isinstance(kvtier.get("devices"), list):
        kvtier["devices"] = [os.path.abspath(d) for d in kvtier["devices"]]
    if isinstance(kvtier.get("meta_dir"), str):
        kvtier["meta_dir"] = os.path.abspath(kvtier["meta_dir"])
    return {**BACKEND, **sglang_extra, **kvtier}


def split_policy(kvtier: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``[kvtier]`` without ``prefetch_policy`` (StoreConfig rejects unknown keys), and the environment it
    asks for. An explicit ``"off"`` is written out too, so the file wins over an inherited variable."""
    store = dict(kvtier)
    if "prefetch_policy" not in store:
        return store, {}
    policy = store.pop("prefetch_policy")
    if policy not in PREFETCH_POLICIES:
        raise ConfigError("kvtier.prefetch_policy", f"must be one of {', '.join(PREFETCH_POLICIES)}, got {policy!r}")
    return store, {ENV_POLICY: policy}


def sglang_args(doc: dict[str, Any], gpu: bool, make_model: bool = True,
                offload: Offload = Offload.L3) -> tuple[str, list[str], dict[str, str]]:
    """(model path, the SGLang flags after it, the environment the server needs on top of ours) of a loaded
    config, without the CPU route. A model size becomes a factory model, served with its ``--dtype``.
    ``offload`` below L3 leaves out the tiers it names (``Offload``); the rest of [sglang] is kept."""
    sg = dict(doc.get("sglang", {}))
    if "model_path" not in sg:
        raise ConfigError("sglang.model_path", "is required")
    kvtier, env = split_policy(doc.get("kvtier", {}))  # a bad value stops here, before SGLang starts
    env.update(plugin_env(kvtier))
    sglang_extra = {k: sg.pop(k) for k in SGLANG_EXTRA_KEYS if k in sg}
    if offload is not Offload.L3:
        env = {}
        sg = {k: v for k, v in sg.items()
              if not k.startswith(("hicache_storage", "enable_hierarchical_cache"))
              and (offload is Offload.L2_ONLY or not k.startswith("hicache_"))}
    model = str(sg.pop("model_path"))
    if model in MODEL_SIZES:
        try:
            path, choice = factory_model(model, sg.get("dtype"), gpu=gpu, make=make_model, source="sglang.dtype")
        except ValueError as exc:
            raise ConfigError("sglang.dtype", str(exc)) from None
        model = str(path)
        if sg.get("dtype") in (None, AUTO):  # SGLang's auto would serve a float32 model in float16
            sg["dtype"] = choice.dtype
    args = {Offload.L3: ["--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic",
                         "--hicache-storage-backend-extra-config", json.dumps(extra_config(kvtier, sglang_extra))],
            Offload.L2_ONLY: ["--enable-hierarchical-cache"], Offload.HBM_ONLY: []}[offload]
    for key, value in sg.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            continue
        elif isinstance(value, list):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]
    return model, args, env


def build_command(doc: dict[str, Any], extra: list[str], gpu: bool, make_model: bool = True) -> tuple[list[str], dict[str, str]]:
    """The server's argv and the environment it needs on top of ours, from a loaded config."""
    model, args, env = sglang_args(doc, gpu, make_model)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, *args]
    if not gpu:
        cmd += [a for a in CPU_ARGS if a not in cmd]
        env["KVTIER_CPU_SHIMS"] = "1"
    return cmd + extra, env


def make_directory_devices(doc: dict[str, Any]) -> None:
    """Create the config's directory devices that do not exist yet (owner-only); ``/dev/`` paths are left alone."""
    for device in doc.get("kvtier", {}).get("devices", []):
        if not Path(device).exists() and not str(device).startswith("/dev/"):
            Path(device).mkdir(parents=True, exist_ok=True, mode=0o700)


def cmd_launch(args: argparse.Namespace, console: Any) -> int:
    """``sgl-kvtier launch``: print the command, or replace this process with the server."""
    doc = load(args.config)
    cmd, env = build_command(doc, args.extra, gpu=has_cuda_gpu(), make_model=not args.print)
    if args.print:
        prefix = " ".join(f"{k}={v}" for k, v in env.items())
        print((prefix + " " if prefix else "") + shlex.join(cmd))
        return 0
    make_directory_devices(doc)
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
    return 0  # pragma: no cover - exec does not return


def add_launch_parser(sub: Any) -> None:
    """Add the ``launch`` sub-command to the CLI's sub-parsers."""
    p = sub.add_parser("launch", help="start an SGLang server with sgl-kvtier as its L3 tier")
    p.add_argument("--config", required=True, help="a configs/*.toml file")
    p.add_argument("--print", action="store_true", help="print the command instead of running it")
    p.set_defaults(func=cmd_launch)
