"""The model a serving run uses: one of the random models made offline, or a path; and its dtype."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def resolve_model(model: str) -> tuple[Path, str]:
    """(model directory, name): ``tiny`` / ``bench`` / ``kvheavy`` are made (or reused) in the model cache."""
    from sgl_kvtier.serving.launch import MODEL_SIZES, model_cache_dir

    if model in MODEL_SIZES:
        from sgl_kvtier.serving.model_factory import make_model

        return make_model(model_cache_dir() / model, model), model
    return Path(model), Path(model).name


def model_dtype(model_dir: Path, server_args: Sequence[str] = ()) -> str:
    """The dtype the servers run the model in: ``--dtype`` if a server argument sets it, else what SGLang's
    ``--dtype auto`` takes from config.json."""
    args = list(server_args)
    for i, arg in enumerate(args):
        if arg.startswith("--dtype="):
            return f"{arg.split('=', 1)[1]} (--dtype)"
        if arg == "--dtype" and i + 1 < len(args):
            return f"{args[i + 1]} (--dtype)"
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "unknown (no config.json)"
    return f"{cfg.get('torch_dtype') or cfg.get('dtype') or 'unknown'} (config.json, --dtype auto)"
