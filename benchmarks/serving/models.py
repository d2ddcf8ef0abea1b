"""The model a serving run uses: one of the random models made offline, or a path; and the dtype it is served in.

The dtype is ``sgl_kvtier.serving.hardware.choose_dtype``'s: ``--dtype`` if given, else ``KVTIER_MODEL_DTYPE``,
else bfloat16 on a GPU run or the CPU's native dtype (bfloat16 with AVX512-BF16/AMX, float32 otherwise), so a
CPU run never times torch's bf16 fallback kernels. A random model is made in that dtype; a model path is served
in it (``--dtype``) on CPU or when forced, and as its config.json says (SGLang's ``--dtype auto``) on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.serving.configs import kv_bytes_per_token
from sgl_kvtier.serving.hardware import AUTO, DTYPE_BYTES, choose_dtype


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """A run's model: its directory and name, the dtype its servers run it (and its KV cache) in, how that
    dtype was chosen, and the server flags that ask for it."""

    path: Path
    name: str
    dtype: str
    dtype_source: str
    server_args: tuple[str, ...] = ()


def config_dtype(model_dir: Path) -> str | None:
    """The dtype config.json gives (``dtype``, or transformers 4's ``torch_dtype``); None without one."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    return str(value) if value else None


def resolve_model(model: str, dtype: str | None = AUTO, gpu: bool = False) -> ServedModel:
    """``tiny`` / ``bench`` / ``kvheavy`` are made (or reused) in the model cache in the chosen dtype; any other
    ``model`` is a path. ``dtype``: ``--dtype`` (``auto`` or None: ``choose_dtype``'s); ``gpu``: a GPU run."""
    from sgl_kvtier.serving.launch import MODEL_SIZES, factory_model

    if model in MODEL_SIZES:
        path, choice = factory_model(model, dtype, gpu=gpu)
        return ServedModel(path, model, choice.dtype, choice.describe(), ("--dtype", choice.dtype))
    path = Path(model)
    choice = choose_dtype(dtype, gpu=gpu)
    if choice.forced or not gpu:
        return ServedModel(path, path.name, choice.dtype, choice.describe(), ("--dtype", choice.dtype))
    return ServedModel(path, path.name, config_dtype(path) or "unknown", "config.json (--dtype auto)")


def _last_value(args: Sequence[str], flag: str) -> str | None:
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(args):
            value = args[i + 1]
    return value


def served_dtype(model: ServedModel, server_args: Sequence[str]) -> tuple[str, str]:
    """(dtype, how it was chosen) of the servers: the last ``--dtype`` of ``server_args`` (a ``--server-arg``
    after the model's own flags wins; SGLang's argparse takes the last), else the model's."""
    flag = _last_value(server_args, "--dtype")
    if flag is None or (flag == model.dtype and model.server_args):
        return model.dtype, model.dtype_source
    if flag != AUTO:
        return flag, "forced: --server-arg --dtype"
    cfg = config_dtype(model.path)
    # SGLang's --dtype auto serves a float32 checkpoint in float16.
    return ("float16" if cfg == "float32" else cfg or "unknown"), "config.json (--server-arg --dtype auto)"


def kv_dtype_bytes(dtype: str, server_args: Sequence[str] = ()) -> int:
    """Bytes of one KV element: ``--kv-cache-dtype`` if set (fp8: 1), else the model dtype's (2 if unknown)."""
    kv = _last_value(server_args, "--kv-cache-dtype")
    if kv is not None and kv != AUTO:
        return 1 if kv.startswith("fp8") else DTYPE_BYTES.get(kv, 2)
    return DTYPE_BYTES.get(dtype, 2)



@dataclasses.dataclass(frozen=True)
class RunModel:
    """A serving benchmark's model as its servers run it: the model, every server flag (the model's own, then
    the ``--server-arg``s), the served dtype and how it was chosen, and KV bytes per token in that dtype."""

    model: ServedModel
    server_args: tuple[str, ...]
    dtype: str
    dtype_source: str
    kv_bytes_per_token: int

    def record(self) -> dict[str, Any]:
        """The ``model`` entry of a result file."""
        return {"name": self.model.name, "path": str(self.model.path), "kv_bytes_per_token": self.kv_bytes_per_token,
                "dtype": self.dtype, "dtype_source": self.dtype_source}


def run_model(model: str, dtype: str | None, gpu: bool, server_args: Sequence[str]) -> RunModel:
    """Resolve ``model`` in ``dtype`` and what its servers will run, with ``server_args`` after its own flags."""
    served = resolve_model(model, dtype, gpu=gpu)
    args = (*served.server_args, *server_args)
    served_as, source = served_dtype(served, args)
    return RunModel(served, args, served_as, source, kv_bytes_per_token(served.path, kv_dtype_bytes(served_as, args)))
