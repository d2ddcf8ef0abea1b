"""Host slots of streamed L3 tails: what SGLang may release, when deferred slots are freed, and the clean-up at
reset / detach. Hooks on the scheduler thread, each leaving SGLang's original untouched unless
``core.active(cache)``; the hooks that create and settle tails are ``hooks.admit``'s.

- **Withhold** (AROUND ``HybridCacheController.append_host_mem_release`` and ``free_prefetch_host_buffers``; every
  other path that releases a prefetch's host slots goes through the former, and ``_handle_prefetch_result`` frees
  directly only head slots, which are settled): ``withhold`` decides what SGLang may release.
- **Reap** (AROUND ``UnifiedRadixCache.check_hicache_events``, the per-step lockstep point): deferred slots are
  freed once their stream ended, the count MIN-reduced so every rank frees the same slots.
- **Clean-up** (AFTER ``reset`` and ``detach_storage_backend``): ``clear_all``.

Invariant: a slot a stream may still write is never freed. Our own failure while withholding keeps the slots (a
counted leak, never a free under a read).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from sgl_kvtier.errors import KVTierError
from sgl_kvtier.experiments.streaming.backend_side import require_side
from sgl_kvtier.experiments.streaming.contract import StreamRegistry, TailState
from sgl_kvtier.experiments.streaming.hooks import accounting as stream_accounting
from sgl_kvtier.experiments.streaming.hooks.core import (
    HCC,
    REGISTRY_ATTR,
    STATS,
    URC,
    active,
    backend_of,
    boundary,
    controller_cache,
    drop,
    guard,
    min_reduce,
)

logger = logging.getLogger(__name__)

END_WAIT_S = 30.0  # reset / detach: bound on waiting for a cancelled stream to end


class _Releases(threading.local):
    seen: list[int] | None = None  # inside _handle_prefetch_result: host releases seen (None: outside)


_releases = _Releases()


@contextmanager
def counting_releases() -> Iterator[list[int]]:
    """The sizes of the host releases ``append_host_mem_release`` gets while the block runs (this thread)."""
    outer, _releases.seen = _releases.seen, []
    try:
        yield _releases.seen
    finally:
        _releases.seen = outer


# ---------------------------------------------------------------------------------------------- the rules
def withhold(cache: Any, host_indices: Any) -> Any:
    """The part of ``host_indices`` SGLang may free now. Never a registered tail's slots (kept back and counted:
    SGLang should not release them at all); of slots a bound stream may still write, only those the binder clears
    (``StreamBinder.claim_released``, which cancels that stream): the rest is deferred until its stream ended."""
    import torch

    registry = active(cache)
    if registry is None:
        return host_indices
    mine = [t.host_indices for t in registry if t.host_indices.numel()]
    if mine:
        ours = torch.isin(host_indices, torch.cat(mine))
        if bool(ours.any()):
            STATS.withheld_registered += int(ours.sum())
            boundary(cache).fail("streamed tail withhold", KVTierError(
                f"SGLang released {int(ours.sum())} slots of registered tails"), outcome="withheld")
            host_indices = host_indices[~ours]
    backend = backend_of(cache)
    if backend is None or host_indices.numel() == 0:
        return host_indices
    releasable, withheld = require_side(backend).binder.claim_released(host_indices)
    for stream, slots in withheld:
        registry.defer_free(stream, slots)
    return releasable


def free_host(cache: Any, slots: list[Any]) -> None:
    """Give ``slots`` (reaped: their streams ended) back to the host pool."""
    import torch

    if slots:
        cache.cache_controller.mem_pool_host.free(torch.cat(slots))


def clear_all(cache: Any, *, free: bool) -> None:
    """Cancel every tail and deferred stream and wait for their ends (bounded by ``END_WAIT_S``, logged if late);
    ``free`` (detach): give the slots of ended streams back; else (reset: SGLang cleared the pools) forget them."""
    registry: StreamRegistry | None = cache.__dict__.get(REGISTRY_ATTR)
    if registry is None:
        return
    for tail in registry:
        if free:
            drop(cache, registry, tail, "detach")
        else:
            registry.remove(tail.rid)
            tail.state = TailState.DROPPED
            tail.stream.cancel()
            registry.defer_free(tail.stream, tail.host_indices)
            guard(cache, "prefetch accounting", "not counted",
                  partial(stream_accounting.settle, cache, tail, kept=False))
    late = 0
    for stream, slots in registry.take_deferred():
        stream.cancel()
        if not stream.wait_ended(END_WAIT_S):
            late += 1
        elif free:
            cache.cache_controller.mem_pool_host.free(slots)
    if late:
        logger.error("kvtier stream: %d tail stream(s) still reading %.0f s after %s; their host slots are %s",
                     late, END_WAIT_S, "detach" if free else "reset", "leaked" if free else "reused")


# ---------------------------------------------------------------------------------------------- withhold
def withhold_release(original: Callable[..., Any], controller: Any, host_indices: Any = None,
                     extra_pools: Any = None) -> Any:
    """AROUND ``append_host_mem_release``: SGLang releases only slots no stream may still write. Every release
    seen inside ``_handle_prefetch_result`` is counted for the register step (``counting_releases``)."""
    if _releases.seen is not None:
        _releases.seen.append(0 if host_indices is None else int(host_indices.numel()))
    cache = None if host_indices is None or host_indices.numel() == 0 else controller_cache(controller)
    if cache is None:
        return original(controller, host_indices, extra_pools)
    kept = guard(cache, "withhold", "slots kept (leaked), never freed under a read",
                  lambda: withhold(cache, host_indices), host_indices[:0])
    return original(controller, kept, extra_pools)


def withhold_free(original: Callable[..., Any], controller: Any, operation: Any, host_indices: Any) -> Any:
    """AROUND ``free_prefetch_host_buffers``: the same rule as the release."""
    cache = None if host_indices is None or host_indices.numel() == 0 else controller_cache(controller)
    if cache is not None:
        host_indices = guard(cache, "withhold", "slots kept (leaked), never freed under a read",
                              lambda: withhold(cache, host_indices), host_indices[:0])
    return original(controller, operation, host_indices)


# ---------------------------------------------------------------------------------------------- reap
def reap_deferred(original: Callable[..., Any], cache: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``check_hicache_events``: decide ``active`` before SGLang's body (so this step's binds see the
    controller), then free the deferred slots every rank can (the MIN of ``ready_to_reap``)."""
    registry = active(cache)
    result = original(cache, *args, **kwargs)
    if registry is not None:
        local = guard(cache, "reap", "nothing freed this step", registry.ready_to_reap, 0)
        count = guard(cache, "reap vote", "nothing freed this step", lambda: min_reduce(cache, [local])[0], 0)
        if count > 0:
            guard(cache, "reap", "slots kept", lambda: free_host(cache, registry.reap(count)))
    return result


# ---------------------------------------------------------------------------------------------- clean-up
def after_reset(result: Any, cache: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``reset`` (flush): the pools were cleared; forget every tail once its stream ended."""
    guard(cache, "reset", "tails forgotten", lambda: clear_all(cache, free=False))
    return None


def after_detach(result: Any, cache: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``detach_storage_backend``: every tail dropped, its slots freed once its stream ended."""
    guard(cache, "detach", "tails forgotten", lambda: clear_all(cache, free=True))
    return None


HOOKS: list[tuple[str, Any, str]] = [
    (HCC + "append_host_mem_release", withhold_release, "AROUND"),
    (HCC + "free_prefetch_host_buffers", withhold_free, "AROUND"),
    (URC + "check_hicache_events", reap_deferred, "AROUND"),
    (URC + "reset", after_reset, "AFTER"),
    (URC + "detach_storage_backend", after_detach, "AFTER"),
]
