"""From SGLang's world (``HiCacheStorageConfig``, the extra-config dict, a host pool) to ours.

Our keys in ``--hicache-storage-backend-extra-config`` are exactly the ``StoreConfig`` fields
(``devices`` and ``capacity_bytes`` are the fixed contract; see README for the rest). Keys that SGLang
itself reads are ignored here; any other unknown key stops start-up with a message naming it.
"""

from __future__ import annotations

from typing import Any

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.keys import Namespace
from sgl_kvtier.sglang.host_pages import HostPages

# Keys SGLang reads (or injects) in the same dict; never ours to validate.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "allocator", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
    "tp_lcm_size", "file_storage_path", "extra_backend_tag",
})


def store_config(extra: dict[str, Any] | None) -> StoreConfig:
    """Our ``StoreConfig`` from the extra-config dict, SGLang's own keys ignored."""
    return StoreConfig.from_mapping(dict(extra or {}), ignore=SGLANG_KEYS)


def namespace_for(cfg: Any, pages: HostPages, pool_name: str = "kv") -> Namespace:
    """The shard this rank reads and writes for one host pool.

    Rank-replicated (MLA) models share one shard across TP ranks (every rank reads it, SGLang elects
    one writer); otherwise each TP rank owns its head slice. DP-attention replicas get their own shard
    (``dp_rank`` is folded into the model field) because each is a separate writer process.
    """
    replicated = bool(getattr(cfg, "is_mla_model", False))
    model = str(cfg.model_name or "unknown-model")
    if getattr(cfg, "dp_rank", 0):
        model += f"@dp{cfg.dp_rank}"
    layout = pages.layout if pool_name == "kv" else f"{pool_name}/{pages.layout}"
    return Namespace(
        model=model, dtype=pages.dtype, layout=layout, page_tokens=pages.page_tokens, page_bytes=pages.page_bytes,
        tp_rank=0 if replicated else cfg.tp_rank, tp_size=1 if replicated else cfg.tp_size,
        pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
        cp_rank=getattr(cfg, "attn_cp_rank", 0), cp_size=getattr(cfg, "attn_cp_size", 1),
    )
