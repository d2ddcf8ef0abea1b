"""SGLang general plugin: streamed L3 tails (issue #13; the design: ``sgl_kvtier.sglang.stream``).

Declared in pyproject.toml as the ``sglang.srt.plugins`` entry point ``kvtier_stream``. ``load()`` registers
the hooks of ``stream_admit`` (bind, register, withhold, gate, virtual hit, load-back, ownership, row
indices, clean-up) and ``stream_load`` (loader, per-layer gate, verdict, retract, requeue) unless
``KVTIER_STREAM=0`` (a kill switch). Every hook is a pass-through unless the cache it runs on has our
backend with ``streaming = "on"`` and the engine is inside this version's scope (``active``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sgl_kvtier.sglang.stream.contract import StreamRegistry

logger = logging.getLogger(__name__)

REGISTRY_ATTR = "_kvtier_stream_registry"
ENV_KILL = "KVTIER_STREAM"
_loaded = False

# (dotted target under sglang.srt, hook function, "AROUND" | "AFTER" | "BEFORE"), per module
HookSpec = tuple[str, Any, str]


def hook_specs() -> list[HookSpec]:
    """Every hook of the streamed tail, in registration order."""
    from sgl_kvtier.sglang.plugins import stream_admit, stream_load

    return [*stream_admit.HOOKS, *stream_load.HOOKS]


def load() -> None:
    """Entry point for ``sglang.srt.plugins``; idempotent within a process."""
    global _loaded
    if _loaded or os.environ.get(ENV_KILL, "") == "0":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    specs = hook_specs()
    for target, fn, kind in specs:
        HookRegistry.register(target, fn, HookType[kind])
    _loaded = True
    logger.info("sgl_kvtier streamed tails: %d hooks registered in pid %d (inert unless streaming = \"on\")",
                len(specs), os.getpid())


def registry_of(cache: Any) -> StreamRegistry:
    """The ``StreamRegistry`` of one ``UnifiedRadixCache`` (made on first use, kept on the cache object)."""
    registry = cache.__dict__.get(REGISTRY_ATTR)
    if registry is None:
        registry = StreamRegistry()
        cache.__dict__[REGISTRY_ATTR] = registry
    return registry
