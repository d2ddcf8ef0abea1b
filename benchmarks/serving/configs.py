"""The five server configurations (a-e), their exact SGLang flags, and pool sizing for memory spill.

All five share the model, the page size and the device KV pool (`--max-total-tokens`), plus
`--enable-cache-report --enable-metrics --skip-server-warmup`. On CPU, `SGLangServer` adds
`--device cpu --attention-backend torch_native --disable-cuda-graph` and the CPU shims, and the HiCache
configurations use `--hicache-io-backend direct --hicache-mem-layout layer_first` (the kernel IO backend
needs a GPU). On a GPU the HiCache IO flags are left at SGLang's defaults unless given.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, TypeVar

from sgl_kvtier.serving.launch import BACKEND


@dataclasses.dataclass(frozen=True)
class ServerPlan:
    """What every configuration of one run shares."""

    page_size: int
    device_tokens: int  # --max-total-tokens
    host_ratio: float  # --hicache-ratio (ignored when host_size_gb > 0)
    host_size_gb: int  # --hicache-size, 0 = use the ratio
    gpu: bool
    l3_root: Path  # each L3 configuration gets l3_root/<name>
    kvtier_capacity_bytes: int
    hicache_io_backend: str | None = None
    hicache_mem_layout: str | None = None
    extra_args: tuple[str, ...] = ()
    log_level: str = "warning"
    kvtier_extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # more keys for kvtier-l3's JSON

    def host_tokens(self, kv_bytes_per_token: int) -> int:
        if self.host_size_gb > 0:
            return int(self.host_size_gb * 1e9 // kv_bytes_per_token)
        return int(self.device_tokens * self.host_ratio)


@dataclasses.dataclass(frozen=True)
class Config:
    key: str
    name: str
    summary: str
    hicache: bool = False
    l3: str | None = None  # "file" or "kvtier"

    def args(self, plan: ServerPlan) -> list[str]:
        args = ["--page-size", str(plan.page_size), "--max-total-tokens", str(plan.device_tokens),
                "--enable-cache-report", "--enable-metrics", "--skip-server-warmup", "--log-level", plan.log_level]
        if self.key == "a":
            args.append("--disable-radix-cache")
        if self.hicache:
            args.append("--enable-hierarchical-cache")
            args += ["--hicache-size", str(plan.host_size_gb)] if plan.host_size_gb > 0 else [
                "--hicache-ratio", f"{plan.host_ratio:g}"]
            io = plan.hicache_io_backend or (None if plan.gpu else "direct")
            layout = plan.hicache_mem_layout or (None if plan.gpu else "layer_first")
            args += ["--hicache-io-backend", io] if io else []
            args += ["--hicache-mem-layout", layout] if layout else []
        if self.l3 == "file":
            args += ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
                     json.dumps({"file_storage_path": str(self.l3_dir(plan))})]
        elif self.l3 == "kvtier":
            extra = {**BACKEND, "devices": [str(self.l3_dir(plan))], "capacity_bytes": plan.kvtier_capacity_bytes,
                     **plan.kvtier_extra}
            args += ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                     json.dumps(extra)]
        return args + list(plan.extra_args)

    def l3_dir(self, plan: ServerPlan) -> Path:
        return plan.l3_root / self.name


CONFIGS: dict[str, Config] = {c.key: c for c in (
    Config("a", "recompute", "--disable-radix-cache: every prompt token is computed"),
    Config("b", "radix", "SGLang's default radix cache, device pool only"),
    Config("c", "hicache-dram", "HiCache: device pool + host-DRAM pool, no L3", hicache=True),
    Config("d", "file-l3", "HiCache + SGLang's built-in `file` L3 (one file per page)", hicache=True, l3="file"),
    Config("e", "kvtier-l3", "HiCache + sgl-kvtier L3 (dynamic backend KVTierStorage)", hicache=True, l3="kvtier"),
)}  # fmt: skip


T = TypeVar("T")


def pick(names: list[str], choices: dict[str, T], aliases: dict[str, str], what: str) -> list[T]:
    """The ``choices`` that ``names`` name (command-line words, each comma separated or not; an alias stands for
    the choice it maps to), in the order of ``choices``, each once; ValueError for a name that is neither."""
    wanted = set()
    for part in (p.strip() for n in names for p in n.split(",")):
        if part:
            name = aliases.get(part, part)
            if name not in choices:
                raise ValueError(f"unknown {what} {part!r}; choose from {list(choices)} or {sorted(aliases)}")
            wanted.add(name)
    return [c for name, c in choices.items() if name in wanted]


def resolve(names: list[str]) -> list[Config]:
    """`a b e` or `recompute radix kvtier-l3` (mixed is fine); kept in a-e order, duplicates dropped."""
    return pick(names, CONFIGS, {c.name: c.key for c in CONFIGS.values()}, "configuration")


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int:
    """K+V bytes of one token over all layers, from config.json's geometry; ``dtype_bytes``: one KV element's
    (``models.kv_dtype_bytes`` of the dtype the servers run; 2, bf16/fp16, unless told)."""
    cfg: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = {**cfg.get("text_config", {}), **cfg}
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return int(cfg["num_hidden_layers"]) * kv_heads * head_dim * 2 * dtype_bytes


def size_device_pool(max_context: int, page: int, factor: float) -> int:
    """Device pool: `factor` x the longest request (prompt + new tokens), whole pages, at least one page
    more than the longest request (SGLang refuses a request that cannot fit)."""
    want = max(math.ceil(max_context * factor), max_context + page)
    return math.ceil(want / page) * page


def host_ratio_for(device_tokens: int, staging_tokens: int, floor: float = 2.0) -> float:
    """SGLang's default ratio (2), raised until the host pool can stage `staging_tokens` of L3 loads
    (max concurrency x the longest request), in steps of 0.1."""
    return max(floor, math.ceil(staging_tokens / device_tokens * 10) / 10)
