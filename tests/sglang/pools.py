"""Real SGLang host pools on the CPU (``pin_memory=False``), as the adapter tests need them, built the way the
installed SGLang release builds them: 0.5.23 hands a host pool its device pool's buffer description
(``get_device_pool_infos``), 0.5.22 the device pool itself."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
BUFFER_INFO = hasattr(MHATokenToKVPool, "get_device_pool_infos")  # SGLang 0.5.23's host pools take buffer info


def host_pool_over(device, page_size: int, layout: str):
    """The host pool of a CPU device pool (MHA or MLA), unpinned, as the installed release builds it."""
    mla = isinstance(device, MLATokenToKVPool)
    cls = MLATokenToKVPoolHost if mla else MHATokenToKVPoolHost
    if not BUFFER_INFO:
        return cls(device, 2.0, 0, page_size, layout, pin_memory=False)
    more = {"target_layer_num": device.layer_num} if mla else {}
    return cls(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout, pin_memory=False,
               device_capacity_tokens=device.size, start_layer=0, end_layer=device.layer_num - 1, **more)


def mha_host_pool(layout: str, page_size: int = 16, layers: int = 2, heads: int = 2, head_dim: int = 64,
                  tokens: int = 1024, dtype=torch.bfloat16) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(tokens, page_size, dtype, heads, head_dim, layers, "cpu", False, start_layer=0,
                              end_layer=layers - 1)
    return host_pool_over(device, page_size, layout)


def mla_host_pool(layout: str = "page_first", page_size: int = 16, layers: int = 2, kv_lora_rank: int = 512,
                  rope: int = 64, tokens: int = 1024, dtype=torch.bfloat16) -> MLATokenToKVPoolHost:
    device = MLATokenToKVPool(tokens, page_size, dtype, kv_lora_rank, rope, layers, "cpu", False, start_layer=0,
                              end_layer=layers - 1)
    return host_pool_over(device, page_size, layout)


def needs(what: str, since: str):
    """Skip where the installed SGLang is older than ``since``, the release that brought ``what``."""
    import pytest

    from sgl_kvtier.sglang.release import installed, release_of

    found = release_of(installed() or "0.0.0")
    older = tuple(map(int, found.split("."))) < tuple(map(int, since.split(".")))
    return pytest.mark.skipif(older, reason=f"{what} is new in SGLang {since} (this is {found})")


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
