"""The shims that let SGLang run HiCache (L1 -> L2 -> L3) on a CPU-only machine.

Why each exists:

1. ``vllm._custom_ops.rotary_embedding``: SGLang's rotary embedding layer imports it when the platform is
   neither CUDA nor SGLang's own CPU engine. Only the import has to succeed: on this route the rotary layer
   runs ``forward_native``, so the stub raises if it is ever called.
2. ``HostKVCache.__init__(pin_memory=...)``: the host-pool assembler hard-codes the default ``pin_memory=True``, which
   asks CUDA to register the buffer; no server flag turns it off.
3. The ``direct`` IO backend's kernels (``transfer_kv_direct`` for ``layer_first``; for ``page_first_direct``
   ``transfer_kv_all_layer_direct_lf_pf`` and ``transfer_kv_per_layer_direct_pf_lf``): the MHA and MLA
   host-pool modules import them from ``sgl_kernel.kvcacheio`` only on CUDA/ROCm/XPU, so on CPU they are
   missing (NameError). Torch stand-ins do the same copies.
4. ``TorchNativeAttnBackend._run_sdpa_forward_extend`` runs causal SDPA over the whole sequence, cached
   prefix included, and keeps only the new tokens' rows, so a prefix hit would not save the attention over
   the prefix as GPU backends do. ``extend_attention_new_queries_only`` computes only the new rows, with a
   bottom-right causal mask: the same output, so CPU timings of cache hits are honest. Sliding windows,
   cross attention, encoder lengths and non-causal calls go to SGLang's own.

This module only defines the shims; ``plugins.cpu.load()`` decides whether to install them. Importing it
pulls in torch but nothing from SGLang.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

import torch

from sgl_kvtier.telemetry.counters import ErrorBoundary

logger = logging.getLogger(__name__)
BOUNDARY = ErrorBoundary(logger)  # the shims' caught exceptions in this process (no backend to count them)

VLLM_STUB_MARKER = "__sgl_kvtier_stub__"
MHA_HOST_MODULE = "sglang.srt.mem_cache.pool_host.mha"
HOST_MODULES = (MHA_HOST_MODULE, "sglang.srt.mem_cache.pool_host.mla")  # each looks the kernels up in its globals
HOST_KV_CACHE_INIT = "sglang.srt.mem_cache.pool_host.base.HostKVCache.__init__"
EXTEND_ATTENTION = ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend."
                    "_run_sdpa_forward_extend")

_unpinned_logged = False
_transfer_logged = False


def _stub_rotary_embedding(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "vllm._custom_ops.rotary_embedding is an sgl_kvtier CPU stub: it only exists so that "
        "SGLang's rotary layer can be imported without vLLM; the CPU route must use forward_native"
    )


def install_vllm_custom_ops_stub() -> bool:
    """Make `from vllm._custom_ops import rotary_embedding` importable; True if a stub was added.

    A real vLLM, if one is installed, is never shadowed. The stub holds only `rotary_embedding`, so
    probes such as `import vllm.distributed.parallel_state` still raise ImportError as SGLang expects.
    """
    existing = sys.modules.get("vllm")
    if existing is not None:
        return False
    if importlib.util.find_spec("vllm") is not None:
        return False
    pkg = types.ModuleType("vllm", "sgl_kvtier stand-in: no vLLM is installed on this machine")
    pkg.__path__ = []  # a package with nothing on disk, so unknown submodules fail to import
    setattr(pkg, VLLM_STUB_MARKER, True)
    ops = types.ModuleType("vllm._custom_ops", "sgl_kvtier stand-in for vLLM's custom ops")
    setattr(ops, "rotary_embedding", _stub_rotary_embedding)  # noqa: B010 - a new module: mypy knows no attributes
    setattr(ops, VLLM_STUB_MARKER, True)
    setattr(pkg, "_custom_ops", ops)  # noqa: B010
    sys.modules["vllm"] = pkg
    sys.modules["vllm._custom_ops"] = ops
    return True


def force_unpinned_host_pool(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """BEFORE hook for `HostKVCache.__init__`: always allocate the host pool unpinned.

    ``pin_memory`` is keyword-only in 0.5.23, so it is always in kwargs.
    """
    global _unpinned_logged
    kwargs["pin_memory"] = False
    if not _unpinned_logged:
        _unpinned_logged = True
        logger.info(
            "sgl_kvtier cpu shim: HostKVCache(pool_label=%s) allocated with pin_memory=False (pid %d)",
            kwargs.get("pool_label", "kv"),
            os.getpid(),
        )
    return args, kwargs


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Torch stand-in for `sgl_kernel.kvcacheio.transfer_kv_direct`.

    Copies rows `src_indices` of every source layer into rows `dst_indices` of the matching
    destination layer (token slots along dim 0). The kernel walks whole pages; index ops copy the
    same slots, so `page_size` only serves as a sanity check here.
    """
    global _transfer_logged
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"transfer_kv_direct: {len(src_layers)} source vs {len(dst_layers)} destination layers")
    if not _slots_to_copy("transfer_kv_direct", src_indices, dst_indices):
        return
    if page_size > 0 and src_indices.numel() % page_size != 0:
        raise ValueError(f"transfer_kv_direct: {src_indices.numel()} slots is not a whole number of pages")
    if not _transfer_logged:
        _transfer_logged = True
        logger.info("sgl_kvtier cpu shim: torch transfer_kv_direct in use (pid %d)", os.getpid())
    runs = contiguous_runs(src_indices, dst_indices)
    if runs is not None:  # one slice copy per run: no gathered temporary, one pass over the bytes
        for src, dst in zip(src_layers, dst_layers):
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n])
        return
    # index_select/index_copy_ need int64 indices on the tensor's own device.
    src_idx = src_indices.to(device=src_layers[0].device, dtype=torch.int64)
    dst_idx = dst_indices.to(device=dst_layers[0].device, dtype=torch.int64)
    for src, dst in zip(src_layers, dst_layers):
        rows = src.index_select(0, src_idx)
        if rows.device != dst.device:
            rows = rows.to(dst.device)
        dst.index_copy_(0, dst_idx, rows)


# A hit's pages allocated together are one run or a few. More than this means scattered slots: one gather
# and one scatter per layer keep the Python calls per layer at two, where slices would take one per run.
MAX_RUNS = 8


def contiguous_runs(src_indices: torch.Tensor, dst_indices: torch.Tensor,
                    max_runs: int = MAX_RUNS) -> list[tuple[int, int, int]] | None:
    """``(src start, dst start, length)`` of the stretches where both index lists count up by one (a load of
    pages allocated together), or None when there are more than ``max_runs``. Equal lengths assumed."""
    n = src_indices.numel()
    s, d = src_indices.reshape(-1).to(torch.int64), dst_indices.reshape(-1).to(torch.int64)
    breaks = torch.nonzero(((s[1:] - s[:-1]) != 1) | ((d[1:] - d[:-1]) != 1)).flatten() + 1
    if breaks.numel() >= max_runs:
        return None
    cuts = [0, *breaks.tolist(), n]
    starts_s, starts_d = s[cuts[:-1]].tolist(), d[cuts[:-1]].tolist()
    return [(a, b, cuts[i + 1] - cuts[i]) for i, (a, b) in enumerate(zip(starts_s, starts_d))]


def _slots_to_copy(kernel: str, src_indices: torch.Tensor, dst_indices: torch.Tensor) -> bool:
    """Whether the stand-in for ``kernel`` has slots to copy; ValueError when source and destination differ."""
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"{kernel}: {src_indices.numel()} source vs {dst_indices.numel()} destination slots")
    return src_indices.numel() > 0


def _page_ids(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """The page of each page-aligned run of ``page_size`` slots in ``indices`` (int64, on its device)."""
    if page_size <= 0 or indices.numel() % page_size != 0:
        raise ValueError(f"{indices.numel()} slots is not a whole number of pages of {page_size}")
    return (indices.view(-1, page_size)[:, 0] // page_size).to(torch.int64)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Torch stand-in for `sgl_kernel.kvcacheio.transfer_kv_all_layer_direct_lf_pf`: device (layer first:
    K of every layer, then V) -> host `page_first_direct` (`[K, V]`, each `(pages, layers, page, ...)`)."""
    if not _slots_to_copy("transfer_kv_all_layer_direct_lf_pf", src_indices, dst_indices):
        return
    layers = len(src_ptrs) // len(dst_ptrs)
    pages = _page_ids(dst_indices, page_size).to(dst_ptrs[0].device)
    rows = src_indices.to(device=src_ptrs[0].device, dtype=torch.int64)
    for kv, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[kv * layers + layer]
            data = src.index_select(0, rows).view(-1, page_size, *src.shape[1:]).to(dst.device)
            dst[:, layer].index_copy_(0, pages, data)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Torch stand-in for `sgl_kernel.kvcacheio.transfer_kv_per_layer_direct_pf_lf`: one layer of host
    `page_first_direct` pages (`[K, V]`) -> the device's layer buffers (`[K_l, V_l]`, token rows)."""
    if not _slots_to_copy("transfer_kv_per_layer_direct_pf_lf", src_indices, dst_indices):
        return
    pages = _page_ids(src_indices, page_size).to(src_ptrs[0].device)
    for src, dst in zip(src_ptrs, dst_ptrs):
        data = src[:, layer_id].index_select(0, pages).reshape(-1, *dst.shape[1:])
        dst.index_copy_(0, dst_indices.to(device=dst.device, dtype=torch.int64), data.to(dst.device))


def install_transfer_kv_direct() -> bool:
    """Give the MHA and MLA host-pool modules the `direct` IO backend's kernels they lack (`transfer_kv_direct`
    for `layer_first`, the two `page_first_direct` ones); True if any was installed.

    HookRegistry cannot do this: it resolves the target with getattr first, and on CPU the names do
    not exist. A real kernel (GPU builds) is never replaced.
    """
    installed = False
    for module in map(importlib.import_module, HOST_MODULES):
        for name, fn in (("transfer_kv_direct", transfer_kv_direct),
                         ("transfer_kv_all_layer_direct_lf_pf", transfer_kv_all_layer_direct_lf_pf),
                         ("transfer_kv_per_layer_direct_pf_lf", transfer_kv_per_layer_direct_pf_lf)):
            if not hasattr(module, name):
                setattr(module, name, fn)
                installed = True
    return installed


def extend_attention_new_queries_only(
    original: Any, backend: Any, query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor, encoder_lens: torch.Tensor | None = None,
    scaling: float | None = None, enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
    sliding_window_size: int | None = None,
) -> torch.Tensor:
    """AROUND hook: SGLang's extend attention, computing only the new tokens' query rows (shim 4 of
    the module docstring).

    Calls SGLang's own for what the shim does not cover, and whenever the shim itself fails (counted and
    logged with its traceback by ``BOUNDARY``): the forward never sees our exception.
    """
    windowed = sliding_window_size is not None and sliding_window_size > -1
    if encoder_lens is None and not is_cross_attn and causal and not windowed:
        try:
            return _new_queries_only(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                     extend_prefix_lens, extend_seq_lens, scaling, enable_gqa)
        except Exception as exc:  # SGLang's own attention recomputes every row of ``output``
            BOUNDARY.fail("CPU extend-attention shim", exc, outcome="SGLang's own attention used")
    rows: torch.Tensor = original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                  extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling,
                                  enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
                                  sliding_window_size=sliding_window_size)
    return rows


def _new_queries_only(
    query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor, scaling: float | None, enable_gqa: bool,
) -> torch.Tensor:
    """The extend-attention shim proper: each request's new query rows against its cached + new keys, into
    ``output``."""
    heads_first = query.dim() - 2
    queries = query.movedim(0, heads_first)  # [heads, tokens, head_dim]
    start = 0
    for i in range(seq_lens.shape[0]):
        new, prefix, total = int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
        tokens = req_to_token[req_pool_indices[i], :total]
        keys = k_cache[tokens].movedim(0, heads_first)
        values = v_cache[tokens].movedim(0, heads_first)
        q = queries[:, start:start + new, :]
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        # New token j sits at position prefix + j and sees keys 0 .. prefix + j: a bottom-right causal mask.
        mask = None if prefix == 0 else torch.ones(new, total, dtype=torch.bool, device=q.device).tril(prefix)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, enable_gqa=enable_gqa,
            scale=scaling, is_causal=prefix == 0)
        output[start:start + new] = out.squeeze(0).movedim(heads_first, 0)
        start += new
    return output
