"""The stand-in prefill of gpu_stream: per layer, the suffix's matmuls sized like the geometry's layer, and an
attention that reads that layer's loaded prefix KV (so a layer cannot compute before its KV is on the device).

One layer (``forward_layer``), S = suffix tokens, T = prefix + suffix tokens:
  qkv = x @ W_qkv  (S x hidden -> S x (Hq + 2 Hkv) D)
  K, V = [prefix K|V of this layer, converted from the KV dtype] ++ [the suffix's own k, v]
  o = softmax(q K^T / sqrt(D)) V  (grouped-query attention, no mask: a 1.5% overcount of the S^2/2 causal half)
  x = x + o @ W_o;  x = x + (silu(x @ W_g) * (x @ W_u)) @ W_d
Weights are random and shared by all layers (they are streamed from HBM every layer either way: the layer's
weights are far larger than the GPU's L2 cache). The values are meaningless; the work is the real shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.gpu.geometry import Geometry
from benchmarks.gpu.kvstore import DeviceKV

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


class StandIn:
    """The stand-in layers of ``geom`` on ``device`` in ``dtype``."""

    def __init__(self, geom: Geometry, device: torch.device, dtype: torch.dtype, seed: int = 1):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        g, d = geom, geom.head_dim
        self.geom, self.dtype = geom, dtype
        self.gqa = "unknown"  # "native" (enable_gqa on a fused kernel) or "repeat", decided by the first call

        def w(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen) / rows**0.5).to(device=device, dtype=dtype)

        self.w_qkv = w(g.hidden, (g.q_heads + 2 * g.kv_heads) * d)
        self.w_o = w(g.q_heads * d, g.hidden)
        self.w_g, self.w_u, self.w_d = w(g.hidden, g.mlp), w(g.hidden, g.mlp), w(g.mlp, g.hidden)
        self.x0 = torch.randn(g.suffix_tokens, g.hidden, generator=gen).to(device=device, dtype=dtype)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention: native (``enable_gqa``) on a fused kernel where one takes it, else with the
        KV heads repeated (what the math kernel would do anyway); the first call decides (``gqa``)."""
        g = self.geom
        if g.q_heads == g.kv_heads:
            return F.scaled_dot_product_attention(q, k, v)
        if self.gqa != "repeat":
            try:
                with sdpa_kernel(FUSED):
                    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                self.gqa = "native"
                return out
            except RuntimeError:  # no fused kernel for this shape / build: repeat the KV heads from now on
                self.gqa = "repeat"
        rep = g.q_heads // g.kv_heads
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))

    def forward_layer(self, layer: int, x: torch.Tensor, kv: DeviceKV) -> torch.Tensor:
        g, d, s = self.geom, self.geom.head_dim, self.geom.suffix_tokens
        q, k, v = (x @ self.w_qkv).split([g.q_heads * d, g.kv_heads * d, g.kv_heads * d], dim=-1)
        keys = torch.cat([kv.layer(0, layer).to(self.dtype), k.reshape(s, g.kv_heads, d)])
        values = torch.cat([kv.layer(1, layer).to(self.dtype), v.reshape(s, g.kv_heads, d)])
        attn = self.attention(q.reshape(s, g.q_heads, d).transpose(0, 1).unsqueeze(0),
                              keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0))
        x = x + attn.squeeze(0).transpose(0, 1).reshape(s, g.q_heads * d) @ self.w_o
        return x + (F.silu(x @ self.w_g) * (x @ self.w_u)) @ self.w_d
