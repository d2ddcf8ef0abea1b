"""SGLang general plugin: streamed L3 tails (the design: ``sgl_kvtier.experiments.streaming``).

Switched on by ``KVTIER_STREAM=1`` through the ``kvtier`` entry point (``sgl-kvtier launch`` sets it for
``streaming = "on"``). ``load()`` registers the hooks of ``hooks.admit`` (bind, register, gate, virtual hit,
load-back, ownership, row indices, abort), ``hooks.slots`` (withhold, reap, reset / detach), ``hooks.load``
(loader, per-layer gate, verdict, retract, requeue), ``hooks.sample`` (prefill samples for the gate's model)
and ``hooks.accounting`` (SGLang's prefetch counters), all of them or none (``register_all``), then attaches a
``StreamingSide`` to every backend made afterwards (``backend_side.install``) and its batch observer to the
prefill samples (``hooks.sample.install``). Every hook is a pass-through unless the cache it runs on has our
backend with ``streaming = "on"`` inside the supported scope (``active``). Of the other experiments it builds
on the layer loader's gate alone (``hooks.copy``); none imports it.

The shared state and rules (``active``, the registry, ``drop``, ``STATS``, ...) live in ``hooks.core`` and are
re-exported here, read-only: a test that replaces one replaces it in ``hooks.core``.
"""

from __future__ import annotations

import logging
import os

from sgl_kvtier.experiments.streaming.backend_side import install
from sgl_kvtier.experiments.streaming.hooks.core import (
    ACTIVE_ATTR,
    CACHE_REF_ATTR,
    REGISTRY_ATTR,
    STATS,
    AdmitStats,
    active,
    backend_of,
    boundary,
    controller_cache,
    device_allocator,
    drop,
    guard,
    min_reduce,
    registry_of,
    scope_problems,
    streaming_enabled,
)
from sgl_kvtier.sglang.plugins import BY_NAME, HookSpec, register_all

logger = logging.getLogger(__name__)

PLUGIN = BY_NAME["stream"]
ENV_FLAG = PLUGIN.env
_loaded = False


def hook_specs() -> list[HookSpec]:
    """Every hook of the streamed tail, in registration order."""
    from sgl_kvtier.experiments.streaming.hooks import accounting as stream_accounting
    from sgl_kvtier.experiments.streaming.hooks import admit as stream_admit
    from sgl_kvtier.experiments.streaming.hooks import load as stream_load
    from sgl_kvtier.experiments.streaming.hooks import sample as stream_sample
    from sgl_kvtier.experiments.streaming.hooks import slots as stream_slots

    return [*stream_admit.HOOKS, *stream_slots.HOOKS, *stream_load.HOOKS, *stream_sample.HOOKS,
            *stream_accounting.HOOKS]


def load() -> None:
    """Register every hook and install the streaming side (``KVTIER_STREAM=1``); idempotent; all hooks or none."""
    global _loaded
    if _loaded or not PLUGIN.wanted():
        return
    specs = hook_specs()
    if not register_all(PLUGIN.name, specs):
        return
    install()  # every backend made from now on in this process carries its streaming side
    from sgl_kvtier.experiments.streaming.hooks import sample as stream_sample

    stream_sample.install()  # every prefill sample taken from now on passes the batch marks first
    _loaded = True
    logger.info("sgl_kvtier streamed tails: %d hooks registered in pid %d (inert unless streaming = \"on\")",
                len(specs), os.getpid())


__all__ = ["ACTIVE_ATTR", "CACHE_REF_ATTR", "ENV_FLAG", "REGISTRY_ATTR", "STATS", "AdmitStats", "HookSpec", "active",
           "backend_of", "boundary", "controller_cache", "device_allocator", "drop", "guard", "hook_specs", "load",
           "min_reduce", "registry_of", "scope_problems", "streaming_enabled"]
