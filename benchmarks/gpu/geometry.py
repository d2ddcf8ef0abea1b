"""Page geometries of gpu_stream and the shapes of the stand-in prefill layer that goes with each.

A geometry is one model's KV page as one rank stores it (layers, page tokens, KV heads, head dim, KV dtype)
plus the per-rank shape of one layer's prefill compute for the suffix (query heads, hidden size, the MLP
width whose gate/up/down matmuls have the layer's active FLOPs) and the hit's shape (prefix tokens in L3,
suffix tokens computed). Flat page layout: K of layers 0..L-1, then V of layers 0..L-1 (SGLang's
``layer_first`` / MHA ``page_first_direct`` flat page, ``sgl_kvtier.sglang.parts_plan``); layer group g of a
page is parts ``[g, G + g]`` of ``LayerPlan``.

- ``kvheavy``: the CPU bed's KV-heavy random model (64 layers, 8 KV heads x 64, bf16, page 16: 2 MiB pages,
  128 KiB of KV per token), its own small layer (hidden 512), a 1,536-token prefix and 64 new tokens;
- ``480b-tp8``: Qwen3-Coder-480B-A35B FP8 on one TP8 rank (62 layers, 1 of 8 KV heads x 128, fp8 KV, page 64:
  992 KiB pages, 15.5 KiB per token per rank), hidden 6144, 12 of 96 query heads, the MoE as its active
  FLOPs per rank (8 experts x 2560 / 8 ranks = one dense gated MLP of 2560), a 64k-token prefix and a
  2k-token suffix (an agentic turn).

``for_cpu_check`` keeps a geometry's pages and layer count (the store path is the same) and shrinks the hit
and the compute so a CPU runs it in seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sgl_kvtier.experiments.streaming.rules.read_groups import even_cuts
from sgl_kvtier.sglang.parts_plan import LayerPlan

KV_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    page_tokens: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    q_heads: int
    hidden: int
    mlp: int  # width of the dense gated MLP standing in for the layer's (active) MLP FLOPs per rank
    prefix_tokens: int
    suffix_tokens: int
    note: str = ""

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_ITEMSIZE:
            raise ValueError(f"{self.name}: kv_dtype {self.kv_dtype!r} is not one of {sorted(KV_ITEMSIZE)}")
        if self.prefix_tokens < self.page_tokens or self.prefix_tokens % self.page_tokens:
            raise ValueError(f"{self.name}: prefix_tokens must be whole pages of {self.page_tokens}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"{self.name}: {self.q_heads} query heads do not share {self.kv_heads} KV heads evenly")

    @property
    def itemsize(self) -> int:
        return KV_ITEMSIZE[self.kv_dtype]

    @property
    def layer_bytes(self) -> int:
        """One layer's K (or V) of one page."""
        return self.page_tokens * self.kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        return 2 * self.layers * self.layer_bytes

    @property
    def pages(self) -> int:
        return self.prefix_tokens // self.page_tokens

    @property
    def prefix_bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.page_bytes // self.page_tokens

    def plan(self, groups: int) -> LayerPlan:
        """The layer groups of a page: ``groups`` groups of layers as even as can be (parts_plan's rule)."""
        if not 1 <= groups <= self.layers:
            raise ValueError(f"{self.name}: groups must be in 1..{self.layers}, got {groups}")
        return LayerPlan("layer_first", self.layers, 2, self.layer_bytes, even_cuts(self.layers, groups))

    def layer_flops(self) -> float:
        """FLOPs of one stand-in layer for the suffix: projections, attention over prefix + suffix, MLP."""
        s, h, d = self.suffix_tokens, self.hidden, self.head_dim
        proj = 2 * s * h * (self.q_heads + 2 * self.kv_heads) * d + 2 * s * self.q_heads * d * h
        attn = 4 * s * (self.prefix_tokens + s) * self.q_heads * d
        return float(proj + attn + 2 * s * h * self.mlp * 3)

    def for_cpu_check(self, pages: int = 4, suffix_tokens: int = 8, hidden: int = 128, mlp: int = 128) -> Geometry:
        return dataclasses.replace(self, prefix_tokens=pages * self.page_tokens, suffix_tokens=suffix_tokens,
                                   hidden=hidden, mlp=mlp, note=f"CPU check of {self.name}: {pages} pages, small compute")


GEOMETRIES = {g.name: g for g in (
    Geometry("kvheavy", 64, 16, 8, 64, "bfloat16", 8, 512, 512, 1536, 64,
             "the CPU bed's KV-heavy model: 2 MiB pages, 128 KiB/token; its own layer"),
    Geometry("480b-tp8", 62, 64, 1, 128, "float8_e4m3fn", 12, 6144, 2560, 65536, 2048,
             "Qwen3-Coder-480B-A35B FP8, one TP8 rank: 992 KiB pages, 15.5 KiB/token; MoE as active FLOPs"),
)}  # fmt: skip
