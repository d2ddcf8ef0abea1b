"""From SGLang's world (``HiCacheStorageConfig``, the extra-config dict, a host pool, the server args) to ours.

Our keys in ``--hicache-storage-backend-extra-config`` are exactly the ``StoreConfig`` fields (``devices``
and ``capacity_bytes`` are the fixed contract; README has the rest). Keys SGLang itself reads are ignored;
any other unknown key stops start-up with a message naming it.

Namespace invariants (``namespace_for``): every rank of every process derives its shard from SGLang's storage
config, the host pool and the weights' identity only, so processes serving the same weights in the same
geometry (two servers, or the DP replicas of one under ``sharing = "host"``) name the same shard, and
anything that changes a page's bytes names another. The weights' identity is the ``model_fingerprint`` key
when given, else ``sgl_kvtier.fingerprint`` over the model files SGLang serves (``weights_identity``); it
never fails start-up. Where the KV pool's layout streams (``parts_plan``) its namespace names its parts too.
"""

from __future__ import annotations

import logging
from typing import Any

from sgl_kvtier.config import Sharing, StoreConfig
from sgl_kvtier.fingerprint import fingerprint_once
from sgl_kvtier.keys import Namespace
from sgl_kvtier.sglang.host_pages import HostPages
from sgl_kvtier.sglang.parts_plan import LayerPlan, unstreamable

log = logging.getLogger(__name__)

# Keys SGLang reads (or injects) in the same dict; never ours to validate.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "allocator", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
    "tp_lcm_size", "file_storage_path", "extra_backend_tag",
})
# Server args (SGLang's ``model`` namespace) that change the KV of the same files; hashed with them.
KV_SETTINGS = ("revision", "quantization", "kv_cache_dtype", "json_model_override_args", "load_format")


def store_config(extra: dict[str, Any] | None) -> StoreConfig:
    """Our ``StoreConfig`` from the extra-config dict, SGLang's own keys ignored."""
    return StoreConfig.from_mapping(dict(extra or {}), ignore=SGLANG_KEYS)


def namespace_for(cfg: Any, pages: HostPages, pool_name: str = "kv", config: StoreConfig | None = None) -> Namespace:
    """The shard this rank reads and writes for one host pool (``config``: the backend's, else parsed
    from ``cfg.extra_config``).

    Rank-replicated (MLA) models share one shard across TP ranks (every rank reads it, SGLang elects
    one writer per DCP shard); otherwise each TP rank owns its head slice. DP-attention replicas are
    writers of one shard under ``sharing = "host"``; under ``sharing = "off"`` each gets its own
    (``dp_rank`` folded into the model field), as one shard then takes one writer process.
    """
    config = config if config is not None else store_config(getattr(cfg, "extra_config", None))
    replicated = bool(getattr(cfg, "is_mla_model", False))
    model = str(cfg.model_name or "unknown-model")
    if getattr(cfg, "dp_rank", 0) and config.sharing == Sharing.OFF:
        model += f"@dp{cfg.dp_rank}"
    layout = pages.layout if pool_name == "kv" else f"{pool_name}/{pages.layout}"
    return Namespace(
        model=model, dtype=pages.dtype, layout=layout, page_tokens=pages.page_tokens, page_bytes=pages.page_bytes,
        tp_rank=0 if replicated else cfg.tp_rank, tp_size=1 if replicated else cfg.tp_size,
        pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
        cp_rank=getattr(cfg, "attn_cp_rank", 0), cp_size=getattr(cfg, "attn_cp_size", 1),
        model_fingerprint=weights_identity(config, cfg.model_name),
        dcp_rank=int(getattr(cfg, "dcp_rank", 0) or 0), dcp_size=int(getattr(cfg, "dcp_size", 1) or 1),
        parts=kv_parts(pages) if pool_name == "kv" else (),
    )


def kv_parts(pages: Any) -> tuple[int, ...]:
    """The checksummed parts of the KV pool's pages: one per (layer group, K|V range) where the layout
    streams (``parts_plan``), else one part (``()``; said once in the log). Each part's digest is taken inside
    the page's own IO (``digest_ranges``, ``store.part_reads``), so a load can be verified group by group."""
    plan: LayerPlan | None = getattr(pages, "plan", None)
    if plan is None:
        unstreamable(pages)
        return ()
    return plan.parts


def weights_identity(config: StoreConfig, model_name: str | None) -> str:
    """The ``model_fingerprint`` of this process's model: the configured one, else computed (once per
    process and model) from the files of SGLang's ``--model-path``; where no server args are published
    (tools, unit tests), from ``model_name`` taken as a path."""
    if config.model_fingerprint is not None:
        return config.model_fingerprint
    model_path, tokenizer_path, settings = served_model(model_name)
    return fingerprint_once(model_path, tokenizer_path, settings).value


def served_model(model_name: str | None) -> tuple[str | None, str | None, tuple[tuple[str, str], ...]]:
    """``(model_path, tokenizer_path, KV settings)`` from SGLang's published server args (the scheduler
    process publishes them before it builds the cache: ``runtime_context.get_model()`` and
    ``get_serving()``); ``(model_name, None, ())`` where nothing is published."""
    try:
        from sglang.srt.runtime_context import get_model, get_serving

        bag = get_model()
        path = getattr(bag, "model_path", None)
        if not path:
            raise ValueError("no model_path published")
        try:
            tokenizer = getattr(get_serving(), "tokenizer_path", None)
        except (ValueError, AttributeError):
            tokenizer = None
        settings = tuple((k, str(v)) for k in KV_SETTINGS if (v := getattr(bag, k, None)) is not None)
        return str(path), (str(tokenizer) if tokenizer else None), settings
    except (ImportError, ValueError, AttributeError, RuntimeError) as exc:
        log.debug("kvtier: no SGLang server args published (%s); the model is %r", exc, model_name)
        return model_name, None, ()
