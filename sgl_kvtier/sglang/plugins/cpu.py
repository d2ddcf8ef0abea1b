"""SGLang general plugin that installs the CPU shims (see `cpu_shims`) in every SGLang process.

Declared in pyproject.toml as the `sglang.srt.plugins` entry point `kvtier_cpu_shims`. SGLang 0.5.23
calls `sglang.srt.plugins.load_plugins()` early in each of its processes: the `launch_server` main
process, `Engine.__init__`, the spawned scheduler (`run_scheduler_process`), the detokenizer and the
DP controller. `load_plugins()` runs every plugin's `load()` and then `HookRegistry.apply_hooks()`.

Opt-in and inert on GPUs: `load()` does nothing unless `KVTIER_CPU_SHIMS=1` is set AND
`torch.cuda.is_available()` is False. The environment variable is read first, so a GPU machine
without it never even touches torch.cuda here. All or nothing (`plugins.register_all`): on an SGLang
release the shims are not tested on, or one missing a target, nothing is installed (one warning).

How each shim is applied:
- `HostKVCache.__init__` (force `pin_memory=False`): through SGLang's `HookRegistry`, as a BEFORE hook.
- torch_native extend attention (new tokens' queries only): through `HookRegistry`, as an AROUND hook.
  The registry applies it right after all plugins have run and also rebinds stale `from ... import`
  copies.
- `vllm._custom_ops` stub: plain `sys.modules` insertion in `load()`. A hook can only wrap an object
  that exists, and here the whole module is missing.
- `transfer_kv_direct`: plain `setattr` on `sglang.srt.mem_cache.pool_host.mha` in `load()`. The
  registry resolves targets with `getattr` first, and on CPU the module never imported that name,
  so REPLACE fails with AttributeError.

`load()` registers the hook but does not apply it. Code that needs the shims outside SGLang's process
start-up (an in-process test harness) should call `sglang.srt.plugins.load_plugins()`, which runs
this plugin and applies its hook.
"""

from __future__ import annotations

import logging
import os

from sgl_kvtier.sglang.plugins import BY_NAME, HookSpec, register_all

logger = logging.getLogger(__name__)

PLUGIN = BY_NAME["cpu_shims"]
ENV_FLAG = PLUGIN.env

_loaded = False


def shims_wanted() -> bool:
    """True when the user opted in and there is no CUDA GPU to run SGLang's real kernels."""
    if not PLUGIN.wanted():
        return False
    import torch  # deferred: SGLang has already imported it wherever this runs

    return not torch.cuda.is_available()


def load() -> None:
    """Entry point for `sglang.srt.plugins`; idempotent within a process."""
    global _loaded
    if _loaded or not shims_wanted():
        return
    # Deferred so that a disabled plugin costs SGLang nothing beyond this module's import.
    from sgl_kvtier.sglang.plugins import cpu_shims

    hooks: list[HookSpec] = [(cpu_shims.HOST_KV_CACHE_INIT, cpu_shims.force_unpinned_host_pool, "BEFORE"),
             (cpu_shims.EXTEND_ATTENTION, cpu_shims.extend_attention_new_queries_only, "AROUND")]
    if not register_all(PLUGIN.name, hooks, targets=cpu_shims.HOST_MODULES):
        return
    stubbed = cpu_shims.install_vllm_custom_ops_stub()
    transfer = cpu_shims.install_transfer_kv_direct()
    _loaded = True
    logger.info(
        "sgl_kvtier CPU shims loaded in pid %d (vllm stub added: %s, transfer_kv_direct stand-in: %s, "
        "HostKVCache pin_memory and extend-attention hooks registered)",
        os.getpid(),
        stubbed,
        transfer,
    )
