"""Bind side of a streamed L3 tail: which hits stream, decided on the scheduler thread before SGLang's IO thread
sees the op. Each hook leaves SGLang's original untouched unless ``core.active(cache)``; the steps after the bind
(register, gate, ...) are ``hooks.admit``'s.

- **Bind** (AFTER ``HybridCacheController.allocate_storage_hit``): its caller, ``_try_alloc_storage_hit``, queues
  the op for the IO thread only after it returns, so the slots are bound before any ``batch_get_v1`` (which,
  once it answered False, gets no more calls for the op: ``HiCacheController._page_transfer``). Not bound (the
  hit loads whole): a request blocked after a failed tail, an op with side pools, a hit another request's L3
  work overlaps or whose engine runs or queues another request (busy), one over the withheld cap, one the bind
  rule (``rules.bind``) loads whole. A hit that streams is read in the groups ``rules.read_groups`` cuts for it.
- **Prompt end** (AFTER ``UnifiedRadixCache.prefetch_from_storage``): the op learns where the request's prompt
  ends (SGLang spans an op only over a hit whose end it knows); the bind rule and the gate need the suffix.
  ``allocate_storage_hit`` runs in a drain after the op's storage query, so this has run by then.

The bind rule's figures are learned here: a hit loaded whole, alone (``sample_whole``), SGLang's own load-backs
(``sample_load_back``), and the forwards that ran with tails (the prefill samplers, ``batch_marks``). Testing only:
``KVTIER_TEST_STREAM_GATE=group0`` (read once at import) leaves the prefill model out: every hit the other
conditions allow streams, and the gate's safe minimum admits it. Nothing raises into SGLang: a failure is counted
on the backend's ``ErrorBoundary`` and the hit loads whole.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from typing import Any

from sgl_kvtier.experiments.streaming.backend_side import require_side
from sgl_kvtier.experiments.streaming.hooks.core import (
    HCC,
    STATS,
    URC,
    active,
    backend_of,
    controller_cache,
    guard,
    others_in_engine,
)
from sgl_kvtier.experiments.streaming.rules import read_groups as stream_read
from sgl_kvtier.experiments.streaming.rules.bind import BindDecision, BindVerdict
from sgl_kvtier.experiments.streaming.rules.read_groups import Cuts, read_cuts

logger = logging.getLogger(__name__)

MAX_WITHHELD = 0.25  # at most this share of the host pool in registered tails (they escape SGLang's rate limit)
ENV_TEST_GATE = "KVTIER_TEST_STREAM_GATE"  # testing only: "group0" (module docstring)
TEST_GATE_GROUP0 = os.environ.get(ENV_TEST_GATE) == "group0"  # read once: the gate polls on every scheduler step
PROMPT_END = "kvtier_prompt_end"  # attribute of a prefetch op: the end of the request's prefix span (tokens)
CUTS_LOG_EVERY_S = 60.0  # a read cut that changed is logged at most this often (the first one at once)
WHOLE_ALONE = "kvtier_whole_alone"  # attribute of a prefetch op: loaded whole by the bind rule, alone
_clock = time.monotonic  # replaceable in tests (SGLang's op start_time is on this clock)


def bind_hit(result: Any, controller: Any, operation: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``allocate_storage_hit``: unless the hit loads whole (module docstring), the backend's streaming side
    binds its keys to its fresh host slots (``StreamingSide.bind_hit``)."""
    cache = controller_cache(controller)
    host_indices = result[0] if isinstance(result, tuple) else None
    if cache is None or host_indices is None or host_indices.numel() == 0:
        return None

    def bind() -> None:
        registry = active(cache)
        if registry is None or registry.is_blocked(operation.handle.rid) or operation.pool_transfers:
            return
        pages = host_indices.numel() // cache.page_size
        backend = backend_of(cache)
        if backend is None or not pages or len(operation.hash_value) < pages:
            return
        # Alone: only a hit no other request's L3 work overlaps streams (no other prefetch in flight, no tail
        # registered, no hit bound): where loads already hide behind other requests' forwards, a tail's stalls
        # would hold their whole batch. Nor one whose engine runs or queues another request (a tail bound alone
        # that others join later is admitted only once landed whole: ``rules.gate``, busy).
        if (len(registry) or require_side(backend).binder.bound_pages() or len(cache.ongoing_prefetch) > 1
                or others_in_engine(cache, operation.handle.rid)):
            STATS.not_registered["busy: loaded whole"] += 1
            return
        # The withheld cap is checked here, before the IO thread sees the op: a hit not bound loads whole
        # before admission; one bound and then refused at registration would be recomputed.
        held = sum(t.tokens for t in registry) + require_side(backend).binder.bound_pages() * cache.page_size
        if held + host_indices.numel() > MAX_WITHHELD * cache.cache_controller.mem_pool_host.size:
            STATS.not_registered["withheld cap: loaded whole"] += 1
            return
        costs = _hit_costs(cache, backend, operation, pages)
        cuts = _read_cuts(backend, pages, costs)
        decision = _bind_rule(cache, backend, pages, costs, cuts)
        if decision is not None and decision.verdict is BindVerdict.WHOLE:
            STATS.not_registered[decision.reason] += 1
            setattr(operation, WHOLE_ALONE, True)  # its load is the rule's sample of W (register_tail)
            return
        require_side(backend).bind_hit(list(operation.hash_value[:pages]), host_indices, cuts)
        STATS.bind_calls += 1
        kv = backend.kv
        if decision is not None and kv is not None:  # the rule's choice: timed to its first token (batch_marks)
            require_side(backend).stream_costs.begin_hit(operation.handle.rid, BindVerdict.STREAM,
                                                         float(operation.start_time), pages * kv.pages.page_bytes)

    guard(cache, "bind", "the hit loads whole, as today", bind)
    return None


@dataclasses.dataclass(frozen=True)
class _HitCosts:
    """One hit's predicted read (the store's read model) and its suffix's compute (the backend's prefill
    model, up to the prompt's end ``note_prompt`` put on the op); None: not measured / no model."""

    read_s: float | None
    compute_s: float | None
    predict: Any  # the prefill model's batch time (None: no model)


def _hit_costs(cache: Any, backend: Any, operation: Any, pages: int) -> _HitCosts:
    kv = backend.kv
    read = backend.cost.read_path()
    model = backend.cost.prefill.model()
    hit_end = int(operation.storage_start) + pages * cache.page_size
    prompt_end = getattr(operation, PROMPT_END, None)
    compute = None if model is None or prompt_end is None else model.time(max(1, int(prompt_end) + 1 - hit_end),
                                                                          hit_end)
    read_s = None if read is None or kv is None else read.device.load_time(pages, kv.pages.page_bytes)
    return _HitCosts(read_s, compute, None if model is None else model.batch_time)


def _read_cuts(backend: Any, pages: int, costs: _HitCosts) -> Cuts | None:
    """The read groups of this hit's stream (``rules.read_groups.read_cuts``: fewer, larger IOs where the hit
    reads fast, a small group 0 where the compute outlasts the read), logged when it changed, at most every
    ``CUTS_LOG_EVERY_S``; None (the pool's layer groups) under the testing knob or without a layer plan."""
    kv = backend.kv
    if TEST_GATE_GROUP0 or kv is None or kv.pages.plan is None:
        return None
    plan = kv.pages.plan
    cuts = read_cuts(plan.bounds, costs.read_s, costs.compute_s, pages, plan.ranges)
    last, now = _last_cuts.get(backend), _clock()
    if last is None or (cuts != last[0] and now - last[1] >= CUTS_LOG_EVERY_S):  # hits of many sizes: no flood
        _last_cuts[backend] = (cuts, now)
        logger.info("kvtier stream: hits of %d pages read in layer groups %s (predicted read %s, compute %s)",
                    pages, cuts, *("-" if x is None else f"{x:.3f}s" for x in (costs.read_s, costs.compute_s)))
    return cuts


def _bind_rule(cache: Any, backend: Any, pages: int, costs: _HitCosts, cuts: Cuts | None) -> BindDecision | None:
    """Stream this hit or load it whole (``rules.bind``), read in the read groups ``cuts`` (None: the pool's
    layer groups); the verdict is logged when it changes. None: the testing knob (every hit streams)."""
    kv = backend.kv
    if TEST_GATE_GROUP0 or kv is None or kv.pages.plan is None:
        return None
    plan = kv.pages.plan
    groups = plan.group_count if cuts is None else len(cuts) - 1
    shares: tuple[float, ...] = () if cuts is None else stream_read.shares(plan.bounds, cuts)
    decision: BindDecision = require_side(backend).stream_costs.decide(
        pages * kv.pages.page_bytes, groups, costs.read_s, costs.compute_s, costs.predict, shares)
    if decision.verdict is not _last_verdict.get(backend):
        _last_verdict[backend] = decision.verdict
        logger.info("kvtier stream: hits of %d pages %s (predicted gain %s; learned %s)", pages, decision.reason,
                    "-" if decision.gain_s is None else f"{decision.gain_s:.3f}s",
                    dataclasses.asdict(require_side(backend).stream_costs.snapshot(costs.predict)))
    return decision


_last_verdict: weakref.WeakKeyDictionary[Any, BindVerdict] = weakref.WeakKeyDictionary()
_last_cuts: weakref.WeakKeyDictionary[Any, tuple[Cuts, float]] = weakref.WeakKeyDictionary()  # last logged, when


def note_prompt(result: Any, cache: Any, request: Any, last_host_node_id: Any, new_input_tokens: Any, *args: Any,
                **kwargs: Any) -> None:
    """AFTER ``prefetch_from_storage``: where the request's prompt ends, on its op (``PROMPT_END``). SGLang shortens
    the op's span to a hit it knows the end of; the bind rule and the gate need the suffix computed after it."""
    def note() -> None:
        info = cache.ongoing_prefetch.get(request) if active(cache) is not None else None
        if info is not None:
            matched = kwargs.get("matched_prefix_tokens", args[2] if len(args) > 2 else None)
            setattr(info.operation, PROMPT_END, len(matched or ()) + len(new_input_tokens))

    guard(cache, "prompt end", "the gate sees the op's span only", note)
    return None


def sample_whole(cache: Any, operation: Any, tokens: int) -> None:
    """A hit the bind rule loaded whole, alone, landed (called by ``hooks.admit.register_tail``): its op's start to
    now is a sample of W, and its request is timed on to its first token (``batch_marks.first_tokens``)."""
    start = float(operation.start_time)
    _record(cache, "record_whole", tokens, _clock() - start)
    found = _costs_of(cache)
    if found is not None and tokens > 0:
        costs, pages = found
        costs.begin_hit(operation.handle.rid, BindVerdict.WHOLE, start, pages.bytes_of(tokens))


def sample_load_back(cache: Any, tokens: int, seconds: float) -> None:
    """SGLang's own load-back of ``tokens`` (``start_loading``, timed by ``hooks.load``) took ``seconds``: a
    sample of X, the host -> device copy a hit loaded whole makes before its forward."""
    if tokens > 0:
        _record(cache, "record_load_back", tokens, seconds)


def _record(cache: Any, method: str, tokens: int, seconds: float) -> None:
    """``StreamCosts.<method>(bytes of tokens, seconds)`` of the backend behind ``cache``, if any."""
    found = _costs_of(cache)
    if found is not None:
        costs, pages = found
        getattr(costs, method)(pages.bytes_of(tokens), seconds)


def _costs_of(cache: Any) -> tuple[Any, Any] | None:
    """(``StreamCosts``, ``HostPages``) of the backend behind ``cache``; None without one (or its KV tier)."""
    backend = backend_of(cache)
    kv = None if backend is None else backend.kv
    return None if backend is None or kv is None else (require_side(backend).stream_costs, kv.pages)


HOOKS: list[tuple[str, Any, str]] = [
    (HCC + "allocate_storage_hit", bind_hit, "AFTER"),
    (URC + "prefetch_from_storage", note_prompt, "AFTER"),
]
