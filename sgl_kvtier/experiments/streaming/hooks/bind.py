"""Bind side of a streamed L3 tail (issue #13; design §2.2 step 1b): which hits stream, hooks on the scheduler
thread, every one SGLang's original untouched unless ``stream.active(cache)`` (line numbers: SGLang 0.5.23).
The steps after it (register, gate, virtual hit, load-back, ...) are ``stream_admit``'s.

1. **Bind** (AFTER ``HybridCacheController.allocate_storage_hit``, ``hybrid_cache_controller.py:796``): its
   caller ``_try_alloc_storage_hit`` queues the op for the IO thread only after it returns
   (``unified_radix_cache.py:3109`` .. ``:3150``), so the backend binds the slots before any
   ``batch_get_v1`` (which, once it answers False, gets no more calls, ``cache_controller.py:1163-1196``).
   Not for a request blocked after a failed tail (it loads whole), an op with side pools, a hit another
   request's L3 work overlaps or whose engine runs or queues another request (busy), one over the withheld
   cap, nor one the bind rule loads whole: ``experiments.streaming.rules.bind`` weighs the hit's predicted read (the store's read model) and its suffix's compute
   (the backend's prefill model) against the figures it learns here: a hit it loads whole, alone, is
   timed from its op's start to SGLang's handling of its result (``sample_whole``, called by
   ``stream_admit.register_tail``), SGLang's own load-backs are timed (``sample_load_back``, called by
   ``stream_load``'s start hook around ``start_loading``), and a forward that ran with tails is timed by
   the prefill samplers (``stall_marks``). The rule's verdict is logged when it changes; every hit it
   loads whole is counted by its reason (``STATS.not_registered``). A hit that streams is read in the
   read groups ``experiments.streaming.rules.read_groups`` cuts from its predicted read and its suffix's compute (fewer, larger
   IOs where it reads fast; a small group 0 where the compute outlasts the read), and the rule weighs it in
   those.
   ``allocate_storage_hit`` runs in a drain after the op's storage query: ``note_prompt`` has run.
2. **Prompt end** (AFTER ``prefetch_from_storage``, ``:2081``): the op is told where the request's prompt
   ends: SGLang spans an op only over a hit whose end it knows (``storage_hit_end``, ``:2113-2124``); the
   rule and the gate need the suffix.

Testing only: ``KVTIER_TEST_STREAM_GATE=group0`` (read once at import) leaves the prefill model out: every
hit the other conditions allow streams, and the gate's safe minimum admits it (``stream_admit``).
Nothing raises into SGLang: a failure is counted on the backend's ``ErrorBoundary`` and the hit loads whole.
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
    """AFTER ``allocate_storage_hit``: the backend binds the hit's keys to its fresh host slots."""
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
        # registered, no hit bound). Measured (benchmarks/RESULTS.md, "bench_streaming"): on a 2-core CPU a
        # lone request gains, while at C = 2-4, where loads already hide behind the other requests'
        # forwards, streaming every hit cost 13-24% (its stalls hold the whole batch).
        # Nor one whose request another one's forward or admission would share the engine with (a tail
        # bound alone that others join later is admitted only once landed whole: ``stream_gate``, busy).
        if (len(registry) or require_side(backend).binder.bound_pages() or len(cache.ongoing_prefetch) > 1
                or others_in_engine(cache, operation.handle.rid)):
            STATS.not_registered["busy: loaded whole"] += 1
            return
        # The withheld cap is checked here, before the IO thread sees the op: a hit not bound loads whole
        # before admission (today's path); one bound and then refused at registration would be recomputed.
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
        if decision is not None and kv is not None:  # the rule's choice: timed to its first token (stall_marks)
            require_side(backend).stream_costs.begin_hit(operation.handle.rid, BindVerdict.STREAM, float(operation.start_time),
                                           pages * kv.pages.page_bytes)

    guard(cache, "bind", "the hit loads whole, as today", bind)
    return None


@dataclasses.dataclass(frozen=True)
class _HitCosts:
    """One hit's predicted read (the store's read model) and its suffix's compute (the backend's prefill
    model, over the prompt's end ``note_prompt`` put on the op); None: not measured / no model."""

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
    """The read groups of this hit's stream (``experiments.streaming.rules.read_groups``: fewer, larger IOs where the hit reads
    fast, a small group 0 where the compute outlasts the read; logged when it changed, at most every
    ``CUTS_LOG_EVERY_S``); None (the pool's layer groups) under the testing knob or without a layer plan.
    Streaming runs on CPU engines only in this version (``stream_core``): the landing's IOs take the
    forward's cores."""
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
    """Stream this hit or load it whole (``experiments.streaming.rules.bind``), read in the read groups ``cuts`` (None: the
    pool's layer groups). None: the testing knob (every hit streams)."""
    kv = backend.kv
    if TEST_GATE_GROUP0 or kv is None or kv.pages.plan is None:
        return None
    plan = kv.pages.plan
    groups = plan.group_count if cuts is None else len(cuts) - 1
    shares: tuple[float, ...] = () if cuts is None else stream_read.shares(plan.bounds, cuts)
    decision: BindDecision = require_side(backend).stream_costs.decide(pages * kv.pages.page_bytes, groups, costs.read_s,
                                                         costs.compute_s, costs.predict, shares)
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
    """AFTER ``prefetch_from_storage``: where the request's prompt ends, on its op. SGLang shortens the op's span
    to a hit it knows the end of (``storage_hit_end``); the gate needs the suffix computed after the tail."""
    def note() -> None:
        info = cache.ongoing_prefetch.get(request) if active(cache) is not None else None
        if info is not None:
            matched = kwargs.get("matched_prefix_tokens", args[2] if len(args) > 2 else None)
            setattr(info.operation, PROMPT_END, len(matched or ()) + len(new_input_tokens))

    guard(cache, "prompt end", "the gate sees the op's span only", note)
    return None


def sample_whole(cache: Any, operation: Any, tokens: int) -> None:
    """A hit the bind rule loaded whole, alone, landed: its op's start to now is a sample of W, and its request
    is timed on to its first token (``stall_marks.first_tokens``)."""
    start = float(operation.start_time)
    _record(cache, "record_whole", tokens, _clock() - start)
    found = _costs_of(cache)
    if found is not None and tokens > 0:
        costs, pages = found
        costs.begin_hit(operation.handle.rid, BindVerdict.WHOLE, start, pages.bytes_of(tokens))


def sample_load_back(cache: Any, tokens: int, seconds: float) -> None:
    """SGLang's own load-back of ``tokens`` (``start_loading``, timed by ``stream_load``) took ``seconds``: a
    sample of X, the host -> device copy a hit loaded whole makes before its forward."""
    if tokens > 0:
        _record(cache, "record_load_back", tokens, seconds)


def _record(cache: Any, method: str, tokens: int, seconds: float) -> None:
    """``require_side(backend).stream_costs.<method>(bytes of tokens, seconds)`` for the backend behind ``cache``, if any."""
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
