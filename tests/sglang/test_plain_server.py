"""A plain SGLang server, with sgl-kvtier installed but not asked for, shows nothing of ours.

The server runs on the CPU without HiCache and without any ``KVTIER_*`` switch: SGLang runs our entry point
in each of its processes, which must then import nothing more, hook nothing and log nothing. What the CPU
needs from outside SGLang is given here without our plugin: an importable ``vllm._custom_ops`` (SGLang
imports it off CUDA; a two-line stand-in on ``PYTHONPATH``, test scaffolding only).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sglang")

from sgl_kvtier.serving.model_factory import make_model  # noqa: E402
from sgl_kvtier.serving.server import SGLangServer  # noqa: E402

pytestmark = pytest.mark.server  # starts real SGLang servers

SWITCHES = ("KVTIER_CPU_SHIMS", "KVTIER_PREFETCH_POLICY", "KVTIER_LAYER_LOADER", "KVTIER_STREAM")


def vllm_stand_in(root: Path) -> Path:
    pkg = root / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_custom_ops.py").write_text("def rotary_embedding(*args, **kwargs):\n    raise RuntimeError('stand-in')\n")
    return root


def test_a_server_that_does_not_use_sgl_kvtier_logs_nothing_of_it(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", "tiny")
    env = {**dict.fromkeys(SWITCHES, ""), "PYTHONPATH": str(vllm_stand_in(tmp_path / "stub"))}
    log = tmp_path / "server.log"
    with SGLangServer(model, extra_args=["--max-total-tokens", "4096", "--skip-server-warmup"], env=env,
                      log_path=log) as srv:
        out = srv.generate("the quick brown fox", max_new_tokens=4)
    assert out["meta_info"]["completion_tokens"] == 4
    text = log.read_text(errors="replace")
    assert "Uvicorn running" in text or "The server is fired up" in text  # the log is the server's whole log
    assert [line for line in text.splitlines() if "kvtier" in line.lower()] == []
