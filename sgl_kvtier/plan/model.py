"""The served model as the planner sees it: KV bytes per token (what the tiers hold) and prefill seconds
(what a hit saves).

``Geometry`` comes from a Hugging Face ``config.json`` (dense or MoE, MHA/GQA or MLA) or from its fields;
its ``pool_bytes_per_token`` is what one instance writes to the L3 per prompt token, all ranks together:
each TP rank stores its own KV heads (``max(1, kv_heads // tp)``, replicated heads stored on every rank),
while an MLA latent is stored once. ``roofline`` derives the cost model's prefill coefficients
(``sgl_kvtier.policy.cost_model.PrefillModel``) from the GPU's FLOPs at a stated utilisation:

    per token          2 * active_params / (tp * flops * mfu)
    per token per 1k   1000 * 4 * layers * q_heads * head_dim / (tp * flops * mfu)   (attention over the context)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_kvtier.errors import ConfigError
from sgl_kvtier.policy.cost_model import PrefillModel

KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class Geometry:
    """KV geometry and compute size of a model as one instance serves it."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_dtype: str = "bfloat16"
    tp: int = 1
    pp: int = 1
    mla_dim: int = 0  # kv_lora_rank + qk_rope_head_dim of an MLA model (0: MHA/GQA)
    active_params: float = 0.0  # parameters one token passes through (MoE: the routed experts only)

    def __post_init__(self) -> None:
        for field in ("layers", "q_heads", "kv_heads", "head_dim", "tp", "pp"):
            if getattr(self, field) < 1:
                raise ConfigError(field, f"must be >= 1, got {getattr(self, field)}")
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise ConfigError("kv_dtype", f"{self.kv_dtype!r} is not one of {sorted(KV_DTYPE_BYTES)}")
        if self.mla_dim < 0 or self.active_params < 0:
            raise ConfigError("mla_dim" if self.mla_dim < 0 else "active_params", "must be >= 0")

    @property
    def pool_bytes_per_token(self) -> int:
        """L3 bytes per prompt token of one instance, all its ranks together."""
        item = KV_DTYPE_BYTES[self.kv_dtype]
        if self.mla_dim:
            return self.layers * self.mla_dim * item
        per_rank_heads = max(1, self.kv_heads // self.tp)
        return self.layers * 2 * per_rank_heads * self.tp * self.head_dim * item

    def roofline(self, tflops: float, mfu: float) -> PrefillModel:
        """Prefill seconds from ``tflops`` dense TFLOP/s per GPU at utilisation ``mfu`` over ``tp`` GPUs."""
        if not tflops > 0:
            raise ConfigError("gpu_tflops", f"must be > 0, got {tflops}")
        if not 0 < mfu <= 1:
            raise ConfigError("mfu", f"must be in (0, 1], got {mfu}")
        if not self.active_params > 0:
            raise ConfigError("active_params", "unknown for this model: give it (e.g. 35e9)")
        rate = self.tp * tflops * 1e12 * mfu
        return PrefillModel(2 * self.active_params / rate,
                            1000 * 4 * self.layers * self.q_heads * self.head_dim / rate)

    @classmethod
    def from_config(cls, path: str | Path, *, kv_dtype: str | None = None, tp: int = 1, pp: int = 1,
                    active_params: float | None = None) -> Geometry:
        """From a ``config.json`` (or a directory holding one); ``active_params`` estimated from the config
        when not given (embeddings left out; MoE: the routed and shared experts one token uses)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        try:
            raw: dict[str, Any] = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError("model", f"cannot read {file}: {exc}") from None
        cfg = {**raw.get("text_config", {}), **raw}
        try:
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("model", f"{file} lacks {exc}") from None
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        mla = int(cfg.get("kv_lora_rank") or 0)
        mla_dim = mla + int(cfg.get("qk_rope_head_dim") or 0) if mla else 0
        dtype = kv_dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        params = active_params if active_params is not None else _active_params(cfg, layers, heads, kv_heads,
                                                                                 head_dim, hidden)
        return cls(str(cfg.get("_name_or_path") or file.parent.name), layers, heads, kv_heads, head_dim, dtype,
                   tp, pp, mla_dim, params)


def _active_params(cfg: dict[str, Any], layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int) -> float:
    """Weights one token passes through: attention projections and the (active) gated MLP of every layer."""
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    experts = int(cfg.get("num_experts_per_tok") or 0)
    if experts and cfg.get("moe_intermediate_size"):
        width = experts * int(cfg["moe_intermediate_size"])
        width += int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"])
        width += int(cfg.get("shared_expert_intermediate_size") or 0)
    else:
        width = int(cfg.get("intermediate_size") or 4 * hidden)
    return float(layers * (attn + 3 * hidden * width))
