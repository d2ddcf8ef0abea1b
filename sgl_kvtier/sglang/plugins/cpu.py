"""The ``cpu_shims`` plugin: installs the CPU shims (``cpu_shims``) in every SGLang process.

Loaded by the ``kvtier`` entry point (``plugins.load``), which SGLang's ``load_plugins()`` runs early in each
of its processes before ``HookRegistry.apply_hooks()``. Opt-in and inert on GPUs: ``load()`` does nothing
unless ``KVTIER_CPU_SHIMS=1`` is set and ``torch.cuda.is_available()`` is False (the variable is read first,
so a GPU machine without it never touches torch.cuda here). All or nothing (``plugins.register_all``): on a
release the shims are not tested on, or one missing a target, nothing is installed (one warning).

How each shim is applied:
- ``HostKVCache.__init__`` (``pin_memory=False``) and the torch_native extend attention (new tokens' queries
  only): ``HookRegistry`` BEFORE and AROUND hooks, applied after all plugins ran (the registry also rebinds
  stale ``from ... import`` copies);
- the ``vllm._custom_ops`` stub: a ``sys.modules`` insertion (a hook can only wrap an object that exists);
- the ``direct`` IO kernels: ``setattr`` on the host-pool modules (the registry resolves targets with
  ``getattr`` first, and on CPU those names are missing).

``load()`` registers the hooks but does not apply them: outside SGLang's process start-up (an in-process
test harness) call ``sglang.srt.plugins.load_plugins()``, which runs this plugin and applies its hooks.
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
