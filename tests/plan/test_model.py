"""plan.model: L3 bytes per token as the ranks store them, and the roofline prefill coefficients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_kvtier.errors import ConfigError
from sgl_kvtier.plan.model import Geometry

# Qwen3-Coder-480B-A35B's published geometry (its config.json's fields).
Q480 = {"num_hidden_layers": 62, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_size": 6144, "moe_intermediate_size": 2560, "num_experts_per_tok": 8, "num_experts": 160,
        "torch_dtype": "bfloat16"}


def test_gqa_heads_split_over_tp_and_replicated_past_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(Q480))
    g = Geometry.from_config(tmp_path, kv_dtype="fp8", tp=8)
    assert g.pool_bytes_per_token == 62 * 2 * 8 * 128  # 124 KiB: one head on each of 8 ranks
    assert g.pool_bytes_per_token // 8 == 15872  # 15.5 KiB per rank
    g16 = Geometry.from_config(tmp_path, kv_dtype="fp8", tp=16)
    assert g16.pool_bytes_per_token == 2 * g.pool_bytes_per_token  # 16 ranks, each stores one (replicated) head
    # active parameters: attention + 8 routed experts of 2560 per layer, about 35B with the embeddings
    assert 25e9 < g.active_params < 35e9


def test_mla_latent_is_stored_once(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "num_key_value_heads": 128, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    g = Geometry.from_config(tmp_path / "config.json", tp=8)
    assert g.pool_bytes_per_token == 61 * 576 * 2


def test_roofline() -> None:
    g = Geometry("m", layers=10, q_heads=8, kv_heads=2, head_dim=64, tp=2, active_params=1e9)
    pm = g.roofline(100, 0.5)
    rate = 2 * 100e12 * 0.5
    assert pm.per_token_s == pytest.approx(2e9 / rate)
    assert pm.per_token_kctx_s == pytest.approx(1000 * 4 * 10 * 8 * 64 / rate)
    assert pm.time(1000, 0) == pytest.approx(1000 * pm.per_token_s + 1000 * 500 / 1000 * pm.per_token_kctx_s)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"layers": 0}, "layers"), ({"kv_dtype": "int3"}, "kv_dtype"), ({"tp": 0}, "tp"), ({"mla_dim": -1}, "mla_dim"),
])
def test_bad_geometry_names_the_field(kwargs: dict, field: str) -> None:
    base = {"name": "m", "layers": 2, "q_heads": 2, "kv_heads": 2, "head_dim": 8}
    with pytest.raises(ConfigError, match=f"^{field}:"):
        Geometry(**(base | kwargs))


def test_roofline_needs_its_inputs(tmp_path: Path) -> None:
    g = Geometry("m", 2, 2, 2, 8)
    with pytest.raises(ConfigError, match="^active_params:"):
        g.roofline(100, 0.4)
    with pytest.raises(ConfigError, match="^mfu:"):
        Geometry("m", 2, 2, 2, 8, active_params=1e9).roofline(100, 1.5)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match="^model: .* lacks"):
        Geometry.from_config(tmp_path)
