"""Real SGLang host pools on the CPU (``pin_memory=False``), as the adapter tests need them."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def mha_host_pool(layout: str, page_size: int = 16, layers: int = 2, heads: int = 2, head_dim: int = 64,
                  tokens: int = 1024, dtype=torch.bfloat16) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(tokens, page_size, dtype, heads, head_dim, layers, "cpu", False, start_layer=0,
                              end_layer=layers - 1)
    return MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                                end_layer=layers - 1)


def mla_host_pool(layout: str = "page_first", page_size: int = 16, layers: int = 2, kv_lora_rank: int = 512,
                  rope: int = 64, tokens: int = 1024, dtype=torch.bfloat16) -> MLATokenToKVPoolHost:
    device = MLATokenToKVPool(tokens, page_size, dtype, kv_lora_rank, rope, layers, "cpu", False, start_layer=0,
                              end_layer=layers - 1)
    return MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                                end_layer=layers - 1, target_layer_num=layers)


def storage_config(extra: dict, model: str = "tiny-model", mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   layout_page_first: bool = True, **fields) -> HiCacheStorageConfig:
    """SGLang's storage config of one rank; ``fields``: any other of its fields (``dp_rank``, ``dcp_size``...)."""
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=layout_page_first, model_name=model, extra_config=extra,
                                **fields)


def fill_random(pool, seed: int = 0) -> None:
    """Random bytes everywhere in the pool's buffer (bf16 via its raw bytes)."""
    g = torch.Generator().manual_seed(seed)
    for buf in _buffers(pool):
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def zero(pool) -> None:
    for buf in _buffers(pool):
        buf.view(torch.uint8).zero_()


def _buffers(pool):
    return [pool.kv_buffer] if getattr(pool, "kv_buffer", None) is not None else [pool.k_buffer]


def page_bytes(pool, start: int) -> bytes:
    return pool.get_data_page(start, flat=True).view(torch.uint8).numpy().tobytes()
