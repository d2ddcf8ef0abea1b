"""Shared state and helpers of the streamed-tail hooks: on or off per cache, the registry, the rank-MIN, the
error boundary, ``drop`` and this process's admission counters (``STATS``).

``active(cache)`` decides once per (cache, backend object) and logs the decision; a backend attached or detached
at run time is a new decision. Supported scope (anything else is off, never an error): cache mode (no buffer
pipeline), no disaggregation, PP = 1, no DP attention, no speculative decoding, no SWA or Mamba component, the KV
host pool only, no external cache linker, and SGLang's device module ``torch.cpu``. The decision depends on the
server's configuration only, so every rank of an engine decides alike (the hooks' collectives rely on it). On,
it hands ``hook_snapshot`` to the backend (``StreamingSide.attach_hooks``), whose ``telemetry()`` then reports
these counters.

``drop`` gives a tail up before its forward: out of the registry, its private device slots freed only while
ADMITTED (from ``prepare_for_extend`` on they are in the request's row, which ``release_kv_cache`` frees), its
stream cancelled, its host slots deferred. The hook modules import this one; of them it imports only ``accounting``
(and, inside ``hook_snapshot``, ``copy`` and ``retract``), none of which imports it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections import Counter
from collections.abc import Callable
from itertools import chain
from typing import Any

from sgl_kvtier.experiments.streaming.backend_side import require_side, side_enabled
from sgl_kvtier.experiments.streaming.contract import StreamedTail, StreamRegistry, TailState
from sgl_kvtier.experiments.streaming.hooks import accounting as stream_accounting
from sgl_kvtier.sglang.prefill_samples import backend_of as backend_of
from sgl_kvtier.telemetry.counters import ErrorBoundary
from sgl_kvtier.telemetry.snapshot import StreamHookSnapshot, frozen_counts

logger = logging.getLogger(__name__)

# hook targets' class prefixes (dotted, under sglang.srt), for the hook modules' HOOKS lists
URC = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache."
HCC = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController."
REGISTRY_ATTR = "_kvtier_stream_registry"
ACTIVE_ATTR = "_kvtier_stream_active"  # on the cache: (weak ref to the backend, registry or None), the decision
CACHE_REF_ATTR = "_kvtier_stream_cache"  # on the controller: a weak reference to its cache (when active)
_orphans = ErrorBoundary(logger)  # failures with no backend of ours to count them


def registry_of(cache: Any) -> StreamRegistry:
    """The ``StreamRegistry`` of one ``UnifiedRadixCache`` (made on first use, kept on the cache object)."""
    registry: StreamRegistry | None = cache.__dict__.get(REGISTRY_ATTR)
    if registry is None:
        registry = StreamRegistry()
        cache.__dict__[REGISTRY_ATTR] = registry
    return registry


# ---------------------------------------------------------------------------------------------- on or off
def kv_bytes(cache: Any, tokens: int) -> int:
    """Bytes of ``tokens`` (whole pages) of the KV pool the backend behind ``cache`` serves (0: none)."""
    backend = backend_of(cache)
    kv = None if backend is None else backend.kv
    return 0 if kv is None else kv.pages.bytes_of(tokens)


def boundary(cache: Any) -> ErrorBoundary:
    """Where a hook on ``cache`` counts what it caught: the backend's boundary, else this module's."""
    backend = None
    try:
        backend = backend_of(cache)
    except Exception:  # noqa: BLE001 - the boundary of last resort must not fail itself
        backend = None
    return _orphans if backend is None else backend.boundary


def streaming_enabled(backend: Any) -> bool:
    """Whether ``backend`` carries a streaming side that streams (``backend_side.side_enabled``)."""
    return side_enabled(backend)


def scope_problems(cache: Any) -> list[str]:
    """Why this engine is outside streaming's supported scope (empty: inside). Reads configuration only."""
    import torch
    from sglang.srt.managers import cache_controller
    from sglang.srt.mem_cache import l2_transfer
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.runtime_context import get_disagg, get_parallel, get_server_args

    problems: list[str] = []
    controller = getattr(cache, "cache_controller", None)
    if controller is None or not getattr(controller, "enable_storage", False):
        problems.append("no HiCache storage")
    if getattr(cache, "linker", None) is not None:
        problems.append("an external cache linker is attached")
    if getattr(cache, "buffer_pipeline", None) is not None or getattr(cache, "host_memory_mode", None) == "buffer_only":
        problems.append("host memory mode buffer_only")
    mode = get_disagg().disaggregation_mode
    if mode not in (None, "null"):
        problems.append(f"disaggregation mode {mode}")
    if int(getattr(cache, "pp_size", 1)) > 1 or int(get_parallel().pp_size) > 1:
        problems.append("pipeline parallelism (PP > 1)")
    if int(get_parallel().attn_dp_size) > 1:
        problems.append("DP attention")
    if get_server_args().speculative_algorithm is not None or getattr(cache.tree_core, "is_eagle", False):
        problems.append("speculative decoding (draft / EAGLE pools)")
    if getattr(cache, "is_swa_enabled", False) or cache.supports_mamba():
        problems.append("an SWA or Mamba component")
    host = getattr(controller, "mem_pool_host", None)
    if host is not None and set(getattr(host, "entry_map", {PoolName.KV: None})) != {PoolName.KV}:
        problems.append("host side pools besides KV")
    if cache_controller.device_module is not torch.cpu or l2_transfer.device_module is not torch.cpu:
        problems.append("a CUDA (non-CPU) device: off in this version")
    return problems


def active(cache: Any) -> StreamRegistry | None:
    """The cache's ``StreamRegistry`` when its tails stream, else None (every hook: SGLang's original).

    Decided once per (cache, backend object), logged once; an error deciding is off (counted)."""
    try:
        backend = backend_of(cache)
    except Exception as exc:
        _orphans.fail("streamed tails: finding the backend", exc, outcome="streaming off")
        return None
    memo = cache.__dict__.get(ACTIVE_ATTR)
    if memo is not None and _decided_for(memo[0], backend):
        registry: StreamRegistry | None = memo[1]
        return registry
    registry, reason = None, "no sgl-kvtier backend behind this cache"
    try:
        if backend is not None:
            problems = [] if streaming_enabled(backend) else ['streaming = "off"']
            problems = problems or scope_problems(cache)
            reason = "; ".join(problems)
            if not problems:
                registry = registry_of(cache)
                cache.cache_controller.__dict__[CACHE_REF_ATTR] = weakref.ref(cache)
                require_side(backend).attach_hooks(hook_snapshot)  # its telemetry() reports this process's counters
    except Exception as exc:
        boundary(cache).fail("streamed tails: scope check", exc, outcome="streaming off")
        registry, reason = None, f"scope check failed ({type(exc).__name__})"
    # The backend weakly: a detached backend (and its host pools) go the moment SGLang drops it.
    cache.__dict__[ACTIVE_ATTR] = (None if backend is None else weakref.ref(backend), registry)
    if registry is not None:
        logger.info("kvtier streamed tails: on for this cache (pid %d)", os.getpid())
    elif backend is not None:
        logger.info("kvtier streamed tails: off for this cache (pid %d): %s", os.getpid(), reason)
    return registry


def _decided_for(ref: weakref.ref[Any] | None, backend: Any) -> bool:
    """Whether the memoised decision (for the backend ``ref`` refers to; None: no backend) is ``backend``'s."""
    return backend is None if ref is None else backend is not None and ref() is backend


def controller_cache(controller: Any) -> Any | None:
    """The (active) cache a HiCache controller serves, for hooks on controller methods (None: not active)."""
    ref = controller.__dict__.get(CACHE_REF_ATTR)
    cache = None if ref is None else ref()
    if cache is None or getattr(cache, "cache_controller", None) is not controller or active(cache) is None:
        return None
    return cache


SCHEDULER_ATTR = "_kvtier_stream_scheduler"  # on the cache: a weak reference to the scheduler running it


def note_scheduler(scheduler: Any) -> None:
    """Remember the scheduler of ``scheduler.tree_cache`` (called after every batch it runs; cheap)."""
    try:
        cache = scheduler.tree_cache
        ref = cache.__dict__.get(SCHEDULER_ATTR)
        if ref is None or ref() is not scheduler:
            cache.__dict__[SCHEDULER_ATTR] = weakref.ref(scheduler)
    except (AttributeError, TypeError):  # no tree cache, or one without a __dict__: "others" stays unknown
        return


def others_in_engine(cache: Any, rid: Any) -> bool:
    """Whether a request other than ``rid`` runs (the running batch) or waits (the waiting queue) on the engine
    of ``cache``; False before the engine ran its first batch (its scheduler is not known yet). Every rank of
    an engine holds the same queues (TP lockstep), so ranks answer alike."""
    ref = getattr(cache, "__dict__", {}).get(SCHEDULER_ATTR)
    scheduler = None if ref is None else ref()
    if scheduler is None:
        return False
    running = getattr(scheduler, "running_batch", None)
    reqs = chain(getattr(running, "reqs", None) or (), getattr(scheduler, "waiting_queue", None) or ())
    return any(_other(r, rid) for r in reqs)  # the gate polls this every scheduler step: no list is built


def _other(req: Any, rid: Any) -> bool:
    """``req`` is another request with work left (a finished one stays in the running batch until the
    scheduler's next step filters it: with ``--sleep-on-idle``, until the next request wakes it)."""
    if getattr(req, "rid", None) == rid:
        return False
    finished = getattr(req, "finished", None)
    return not (callable(finished) and finished())


def min_reduce(cache: Any, values: list[int]) -> list[int]:
    """Rank-MIN of ``values`` over the cache's TP/PP ranks (``cache._all_reduce``; scheduler thread, lockstep)."""
    import torch

    tensor = torch.tensor(values, dtype=torch.int64, device="cpu")
    cache._all_reduce(tensor, torch.distributed.ReduceOp.MIN)
    return [int(v) for v in tensor.tolist()]


# ---------------------------------------------------------------------------------------------- tails
@dataclasses.dataclass
class AdmitStats:
    """What the admission side did in this process (``hooks.admit``)."""

    bind_calls: int = 0  # hits handed to StreamingSide.bind_hit (it may decline)
    registered: int = 0
    ready: int = 0  # tails the gate let through (READY)
    admitted: int = 0
    gate_waits: int = 0  # admission polls the gate answered "not yet" (the request skipped that round)
    gate_wait_s: float = 0.0  # registration to READY, summed over the tails the gate let through
    withheld_registered: int = 0  # slots of registered tails SGLang tried to release (kept back; a bug upstream)
    # why hits did not stream: at registration, or at binding ("withheld cap: loaded whole")
    not_registered: Counter[str] = dataclasses.field(default_factory=Counter)
    dropped: Counter[str] = dataclasses.field(default_factory=Counter)


STATS = AdmitStats()


def drop(cache: Any, registry: StreamRegistry, tail: StreamedTail, why: str) -> None:
    """Give ``tail`` up: forget it, free its private device slots (ADMITTED only), cancel, defer host slots."""
    registry.remove(tail.rid)
    before, tail.state = tail.state, TailState.DROPPED
    if before is TailState.ADMITTED and tail.device_indices is not None:
        device_allocator(cache).free(tail.device_indices)
        tail.device_indices = None
    tail.stream.cancel()
    registry.defer_free(tail.stream, tail.host_indices)
    STATS.dropped[why] += 1
    guard(cache, "prefetch accounting", "not counted", lambda: stream_accounting.settle(cache, tail, kept=False))
    logger.debug("kvtier stream: tail of %s dropped (%s): %d tokens", tail.rid, why, tail.tokens)


def device_allocator(cache: Any) -> Any:
    """The full-attention device pool's allocator (as SGLang's ``FullComponent._full_allocator`` picks it)."""
    allocator = cache.token_to_kv_pool_allocator
    return allocator.full_attn_allocator if getattr(cache, "is_swa_enabled", False) else allocator


def alloc_device(cache: Any, tokens: int) -> Any:
    """``tokens`` device slots of the full-attention pool (int64), evicting the tree for them; None: no room."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    allocator = device_allocator(cache)
    shortfall = tokens - allocator.available_size()
    if shortfall > 0:
        cache.evict(EvictParams(num_tokens=shortfall))
    slots = allocator.alloc(tokens)
    return None if slots is None else slots.to(torch.int64)


def guard(cache: Any, what: str, outcome: str, fn: Callable[[], Any], fallback: Any = None) -> Any:
    """``fn()``, or ``fallback`` when it raised (counted on the backend's boundary with ``outcome``)."""
    try:
        return fn()
    except Exception as exc:
        boundary(cache).fail(f"streamed tail {what}", exc, outcome=outcome)
        return fallback


def hook_snapshot() -> StreamHookSnapshot:
    """This process's counters of the stream hooks, typed: admission (``STATS``), the tail loader
    (``hooks.copy.stats``) and the retract path (``hooks.retract.stats``)."""
    from sgl_kvtier.experiments.streaming.hooks import copy as stream_copy
    from sgl_kvtier.experiments.streaming.hooks import retract as stream_retract

    a, load, retract = STATS, stream_copy.stats(), stream_retract.stats()
    return StreamHookSnapshot(
        bind_calls=a.bind_calls, tails=a.registered, ready=a.ready, admitted=a.admitted, gate_waits=a.gate_waits,
        gate_wait_s=a.gate_wait_s, withheld_registered_slots=a.withheld_registered,
        not_streamed=frozen_counts(a.not_registered), dropped=frozen_counts(a.dropped),
        loads=load["loads"], loaded_tails=load["tails"], copied_layers=load["layers_copied"],
        zeroed_layers=load["layers_zeroed"], zero_filled_groups=load["failed_groups"], timeouts=load["timeouts"],
        landed=load["landed"], poisoned=load["poisoned"], stalls=load["blocked_waits"], stall_s=load["blocked_s"],
        retracts=retract["retracted"], requeued=retract["requeued"], aborted=retract["aborted"])
