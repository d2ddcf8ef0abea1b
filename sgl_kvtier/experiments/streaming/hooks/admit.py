"""Admission side of a streamed L3 tail: the hooks from a bound hit's result to its forward's device slots.

Each hook runs on the scheduler thread and leaves SGLang's original untouched unless ``core.active(cache)``:
register (``UnifiedRadixCache._handle_prefetch_result``), gate (``check_prefetch_progress``), virtual host hit
(``_finalize_match_result``), load-back (``init_load_back``), ownership (``PrefillAdder.add_one_req``), row indices
(``prefix_device_indices``) and abort (``release_aborted_request``). Which hits stream is ``hooks.bind``'s (its hooks
come first in ``HOOKS``); the withheld host slots are ``hooks.slots``'. Every decision SGLang sees is MIN-reduced
over the ranks. Nothing raises into SGLang: a failure is counted on the backend's ``ErrorBoundary`` and falls back
to SGLang's behaviour (for a tail: dropped, as if it never streamed).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from sgl_kvtier.experiments.streaming.backend_side import require_side
from sgl_kvtier.experiments.streaming.contract import GroupVerdict, StreamedTail, StreamRegistry, TailState
from sgl_kvtier.experiments.streaming.hooks import accounting as stream_accounting
from sgl_kvtier.experiments.streaming.hooks import bind as stream_bind
from sgl_kvtier.experiments.streaming.hooks.core import (
    STATS,
    URC,
    active,
    alloc_device,
    backend_of,
    device_allocator,
    drop,
    guard,
    kv_bytes,
    min_reduce,
    others_in_engine,
)
from sgl_kvtier.experiments.streaming.hooks.slots import counting_releases
from sgl_kvtier.experiments.streaming.rules import gate as stream_gate
from sgl_kvtier.experiments.streaming.rules import read_groups as stream_read
from sgl_kvtier.sglang import plugins

logger = logging.getLogger(__name__)

_clock = time.monotonic  # replaceable in tests


@dataclasses.dataclass
class TailInfo:
    """What the gate keeps of one registered tail besides its ``StreamedTail``."""

    registered_at: float
    deadline_s: float
    suffix_tokens: int  # the prompt's prefix end (``note_prompt``) + 1 - the tail's end
    interference_s: float | None = None  # the landing's cost to the forward (k x bytes), at the first verdict
    shares: tuple[float, ...] = ()  # each read group's share of the tail (``_shares``), at the first verdict


_info: weakref.WeakKeyDictionary[StreamedTail, TailInfo] = weakref.WeakKeyDictionary()


class _Ctx(threading.local):
    in_progress = 0  # inside check_prefetch_progress


_ctx = _Ctx()


def _tail(cache: Any, rid: Any) -> tuple[StreamRegistry | None, StreamedTail | None]:
    registry = active(cache)
    return registry, (None if registry is None or rid is None else registry.get(rid))


# ---------------------------------------------------------------------------------------------- register
def register_tail(original: Callable[..., Any], cache: Any, operation: Any) -> Any:
    """AROUND ``_handle_prefetch_result``: the part of the hit not landed becomes a streamed tail.

    Only from the ack drain (``_drain_storage_control_queues_impl``: the op's IO thread issued its last get); from
    ``check_prefetch_progress`` (a terminated op whose IO may still run) nothing streams. After SGLang's original
    (the head insert), this rank's "can stream" (``_why_not``, and the binder gives up the op's stream) is
    MIN-reduced: a collective on every rank at every ack-drained result. Once we took the stream we own
    ``host_indices[completed:]``: ``ack_releases_incomplete_host_indices = False`` stops SGLang's release of them
    (it reads the flag right after the original returns) and a tail not agreed is dropped at once. SGLang's
    unfulfilled count of the part not landed is held while the original runs and made only for a part that does
    not stream (``hooks.accounting``).
    """
    registry = active(cache)
    if registry is None or _ctx.in_progress:  # early cut: the op's IO may still run, nothing streams
        return original(cache, operation)
    info = cache.ongoing_prefetch.get(operation.handle)
    host_indices: Any = None if info is None else info.host_indices
    completed = int(operation.completed_tokens)
    with counting_releases() as releases, stream_accounting.holding(cache, operation.handle) as held:
        result = original(cache, operation)  # SGLang's unfulfilled log of the part not landed: held
    landed_whole = host_indices is not None and completed == host_indices.numel()
    if landed_whole and getattr(operation, stream_bind.WHOLE_ALONE, False):  # the bind rule's sample of W
        guard(cache, "bind rule sample", "not sampled", lambda: stream_bind.sample_whole(cache, operation, completed))
    taken: list[Any] = []

    def local() -> str | None:  # None: this rank can stream it; else why not
        why = _why_not(cache, registry, operation, host_indices, completed, releases)
        backend = backend_of(cache)
        if why is None and backend is not None:
            stream = require_side(backend).binder.take(host_indices)
            if stream is None:
                return "not bound"
            taken.append(stream)
            if stream.pages * cache.page_size != host_indices.numel():
                return "stream does not cover the hit"
        return why

    why = guard(cache, "registration", "not streamed", local, "error")
    agreed = guard(cache, "registration vote", "not streamed", lambda: min_reduce(cache, [why is None])[0] == 1,
                    False)
    tail = None
    if taken:
        operation.ack_releases_incomplete_host_indices = False  # host_indices[completed:] are ours now
        tail = guard(cache, "registration", "tail dropped", lambda: _settle(
            cache, registry, operation, host_indices, completed, taken[0], agreed and why is None))
    if tail is None:  # not streamed: SGLang's count of the part not landed, as it would have made it
        guard(cache, "prefetch accounting", "not counted", lambda: stream_accounting.release(cache, held))
    else:
        stream_accounting.hold(tail, held)
    if not (agreed and why is None):
        STATS.not_registered[why or "another rank"] += 1
    return result


def _why_not(cache: Any, registry: StreamRegistry, operation: Any, host_indices: Any, completed: int,
             releases: list[int]) -> str | None:
    rid = operation.handle.rid
    if host_indices is None or completed >= host_indices.numel():
        return "no tail"
    if releases:
        return "head not inserted"
    if registry.is_blocked(rid) or registry.get(rid) is not None:
        return "blocked"
    if operation.pool_transfers:
        return "side pools"
    withheld = sum(t.tokens for t in registry) + host_indices.numel() - completed
    if withheld > stream_bind.MAX_WITHHELD * cache.cache_controller.mem_pool_host.size:
        return "withheld cap"
    return None


def _settle(cache: Any, registry: StreamRegistry, operation: Any, host_indices: Any, completed: int,
            stream: Any, keep: bool) -> StreamedTail | None:
    """The tail registered (None: not kept; its stream is cancelled and its slots deferred)."""
    ps = cache.page_size
    first = completed // ps
    tail = StreamedTail(rid=operation.handle.rid, stream=stream, first_page=first,
                        token_start=int(operation.storage_start) + completed, tokens=host_indices.numel() - completed,
                        host_indices=host_indices[completed:], hashes=tuple(operation.hash_value[first:]))
    if not keep:
        stream.cancel()
        registry.defer_free(stream, tail.host_indices)
        return None
    span_end = max(int(operation.storage_start) + int(getattr(operation, "stats_requested_tokens", 0) or 0),
                   int(getattr(operation, stream_bind.PROMPT_END, 0)))
    pages = tail.tokens // ps
    _info[tail] = TailInfo(_clock(), cache.prefetch_timeout_base + pages * cache.prefetch_timeout_per_page,
                           max(1, span_end + 1 - tail.token_end))
    registry.register(tail)
    STATS.registered += 1
    logger.debug("kvtier stream: tail of %s registered: %d head + %d streamed tokens", tail.rid, completed,
                 tail.tokens)
    return tail


# ---------------------------------------------------------------------------------------------- gate
def gate(original: Callable[..., Any], cache: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``check_prefetch_progress``: a REGISTERED tail holds its request (False: skipped this round, not
    blocking the queue) until ``rules.gate`` says READY; DROP drops the tail and the request is admitted with its
    head only. Both flags (ready, keep) are MIN-reduced."""
    registry, tail = _tail(cache, getattr(request, "rid", None))
    if registry is not None and tail is not None and tail.state is TailState.REGISTERED:
        verdict = guard(cache, "gate", "tail dropped", lambda: local_verdict(cache, tail), stream_gate.Verdict.DROP)
        ready, keep = guard(cache, "gate vote", "tail dropped", lambda: min_reduce(
            cache, [verdict is stream_gate.Verdict.READY, verdict is not stream_gate.Verdict.DROP]), [0, 0])
        if not keep:
            guard(cache, "gate", "tail dropped", lambda: drop(cache, registry, tail, "gate"))
        elif ready:
            tail.state = TailState.READY
            STATS.ready += 1
            info = _info.get(tail)
            if info is not None:
                STATS.gate_wait_s += max(0.0, _clock() - info.registered_at)
        else:
            STATS.gate_waits += 1
            return False  # skipped this round, not blocking the queue
    _ctx.in_progress += 1
    try:
        return original(cache, request, *args, **kwargs)
    finally:
        _ctx.in_progress -= 1


def local_verdict(cache: Any, tail: StreamedTail) -> stream_gate.Verdict:
    """This rank's T_hide verdict for ``tail`` (``rules.gate``), from the stream and the backend's prefill model."""
    stream = tail.stream
    info = _info.get(tail) or TailInfo(_clock(), 0.0, 1)
    failed = stream.wait_group(stream.groups - 1, tail.first_page, 0) is GroupVerdict.FAILED
    landed0 = stream.wait_group(0, tail.first_page, 0) is GroupVerdict.LANDED
    backend = backend_of(cache)
    # Testing only: KVTIER_TEST_STREAM_GATE=group0 leaves the prefill model out: the gate's safe minimum decides
    # (READY once group 0 landed), so a real-server test sees each tail admitted whatever the machine's load.
    model = None if backend is None or stream_bind.TEST_GATE_GROUP0 else backend.cost.prefill.model()
    suffix = full = None
    interference = 0.0
    if model is not None:
        suffix = model.time(info.suffix_tokens, tail.token_end)
        interference = _interference_s(cache, backend, model, tail, info)
        # Recomputing instead of waiting is the cost policy's call (its plugin runs: KVTIER_PREFETCH_POLICY=cost):
        # without it a hit loaded whole is never recomputed for being slow, nor is a tail (it waits, to its deadline).
        recompute = plugins.running("cost_policy")
        full = model.time(info.suffix_tokens + tail.tokens, tail.token_start) if recompute else None
    settled = stream.rate_settled()
    if not info.shares:  # the stream's read groups never change: taken once per tail (the gate polls every round)
        info.shares = _shares(stream)
    return stream_gate.decide(stream_gate.GateInputs(
        groups=stream.groups, shares=info.shares, tail_bytes=kv_bytes(cache, tail.tokens),
        remaining_bytes=stream.remaining_bytes(tail.first_page), group0_landed=landed0,
        failed=failed, waited_s=_clock() - info.registered_at, deadline_s=info.deadline_s,
        read_rate_Bps=stream.read_rate(), rate_settled=settled,
        device_rate_Bps=None if settled or not landed0 or model is None else _device_rate(backend),  # else unused
        suffix_compute_s=suffix, full_compute_s=full, interference_s=interference,
        busy=not stream_bind.TEST_GATE_GROUP0 and others_in_engine(cache, tail.rid)))


def _shares(stream: Any) -> tuple[float, ...]:
    """Each of ``stream``'s read groups' share of its layers (``rules.read_groups.shares`` over its layer bounds)."""
    bounds = [stream.layers(0).start, *(stream.layers(g).stop for g in range(stream.groups))]
    return stream_read.shares(bounds, range(stream.groups + 1))


def _device_rate(backend: Any) -> float | None:
    """The store's measured read bandwidth (through the cost policy's read path; None: not measured)."""
    path = backend.cost.read_path()
    return None if path is None else path.device.bandwidth_Bps


def _interference_s(cache: Any, backend: Any, model: Any, tail: StreamedTail, info: TailInfo) -> float:
    """What the tail's landing adds to its forward: the bind rule's learned ``k`` (judged against ``model``)
    x the tail's bytes, 0.0 while ``k`` is unknown. Taken once per tail (the gate polls every scheduler round)."""
    if info.interference_s is None:
        k = require_side(backend).stream_costs.interference_s_per_byte(model.batch_time)
        info.interference_s = 0.0 if k is None else k * kv_bytes(cache, tail.tokens)
    return info.interference_s


# ---------------------------------------------------------------------------------------------- virtual hit
def virtual_hit(result: Any, cache: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``_finalize_match_result``: a READY tail starting at the match's end (device + host) and ending within
    the key is reported as host hit (``host_hit_length``, as ``UnifiedCacheLinkerWrapper.match`` extends it). A key
    reaching the tail's end whose match ends elsewhere (head evicted, tail computed meanwhile) drops a REGISTERED or
    READY tail."""
    req = getattr(params, "req", None)
    registry, tail = _tail(cache, getattr(req, "rid", None))
    if registry is None or tail is None or tail.state not in (TailState.REGISTERED, TailState.READY):
        return None
    end = int(result.device_prefix_len) + int(result.host_hit_length)
    reach = len(params.key)
    if end != tail.token_start:
        if reach >= tail.token_end:  # the key reaches the tail, the tree does not end at its start
            guard(cache, "match", "tail dropped", lambda: drop(cache, registry, tail, "match moved"))
        return None
    if tail.state is not TailState.READY or tail.token_end > reach:
        return None
    return result._replace(host_hit_length=int(result.host_hit_length) + tail.tokens,
                           full_kv_hit_length=max(int(result.full_kv_hit_length), tail.token_end))


# ---------------------------------------------------------------------------------------------- load-back
def load_back(original: Callable[..., Any], cache: Any, params: Any) -> Any:
    """AROUND ``init_load_back``: the tail's private device slots (evicting the tree for them), then SGLang's load
    of the tree part. All or nothing, as ``PrefillAdder.add_one_req`` expects: a shortfall frees the slots and
    answers ``(0, req.last_node)`` (or SGLang's answer for the tree part); else the tail is queued (ADMITTED) and
    the answer is ``(tree + tail, node)``."""
    req = params.req
    registry, tail = _tail(cache, getattr(req, "rid", None))
    if (registry is None or tail is None or tail.state is not TailState.READY or params.host_hit_length < tail.tokens
            or req.prefix_len + params.host_hit_length != tail.token_end):
        return original(cache, params)
    slots = guard(cache, "device slots", "loaded without the tail", lambda: alloc_device(cache, tail.tokens))
    if slots is None:
        return 0, req.last_node  # all or nothing: no device room for the tail, none of the hit loads
    tree_part = params.host_hit_length - tail.tokens
    try:
        loaded = original(cache, dataclasses.replace(params, host_hit_length=tree_part))
    except BaseException:
        device_allocator(cache).free(slots)
        raise
    if loaded is None or int(loaded[0]) != tree_part:
        device_allocator(cache).free(slots)  # the tree part did not load as promised: no tail either
        return loaded
    tail.device_indices = slots
    registry.queue_load(tail)
    STATS.admitted += 1
    _count_as_storage(req, tail, +1)
    return int(loaded[0]) + tail.tokens, loaded[1]


def _count_as_storage(req: Any, tail: StreamedTail, sign: int) -> None:
    """The admitted tail is read from L3: SGLang's storage span of ``req`` (popped at admission, read by
    ``_account_prefill_cache_admission`` and ``split_cached_prefix_by_tier``) grows by it (shrinks back: undone)."""
    length = int(getattr(req, "storage_hit_length", 0) or 0)
    if sign > 0 and length <= 0:
        req.storage_hit_start = tail.token_start
    req.storage_hit_length = max(0, length + sign * tail.tokens)


# ---------------------------------------------------------------------------------------------- ownership
def add_one_req(original: Callable[..., Any], adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``PrefillAdder.add_one_req``: admitted with its tail (``req is can_run_list[-1]``, SGLang's own test),
    the tail is request-owned KV (``cache_protected_len = prefix_len - tail.tokens``: freed by ``release_kv_cache``,
    inserted by the request's own checkpoint). Not admitted after the load-back: slots freed, READY again.
    Admitted without it (the request computes it): the tail is dropped."""
    cache = adder.tree_cache
    registry, tail = _tail(cache, getattr(req, "rid", None))
    if registry is None or tail is None or tail.state not in (TailState.REGISTERED, TailState.READY):
        return original(adder, req, *args, **kwargs)
    try:
        result = original(adder, req, *args, **kwargs)
    except BaseException:
        if tail.device_indices is not None:  # the load-back ran: undo it
            guard(cache, "ownership", "slots kept", lambda: _unadmit(cache, registry, tail))
        raise
    admitted = bool(adder.can_run_list) and adder.can_run_list[-1] is req
    state: TailState = tail.state  # the original may have moved it on (load-back: ADMITTED)
    if state is TailState.ADMITTED:
        if admitted:
            req.kv.cache_protected_len = req.prefix_len - tail.tokens  # [token_start, token_end): request-owned
        else:
            guard(cache, "ownership", "slots kept", lambda: _unadmit(cache, registry, tail))
            _count_as_storage(req, tail, -1)
    elif admitted and state in (TailState.REGISTERED, TailState.READY):  # computed by the request itself
        guard(cache, "ownership", "tail dropped", lambda: drop(cache, registry, tail, "computed"))
    return result


def _unadmit(cache: Any, registry: StreamRegistry, tail: StreamedTail) -> None:
    """Undo a load-back the adder did not keep: device slots freed, the tail back to READY (not queued)."""
    if tail.device_indices is not None:
        device_allocator(cache).free(tail.device_indices)
        tail.device_indices = None
    registry.remove(tail.rid)  # out of the load queue too
    tail.state = TailState.READY
    registry.register(tail)


# ---------------------------------------------------------------------------------------------- row indices
def prefix_device_indices(original: Callable[..., Any], cache: Any, req: Any) -> Any:
    """AROUND ``prefix_device_indices`` (read for a request without a row, ``allocation._prefix_kv_indices``): the
    request's tree path, then its private tail slots, as SGLang does for a linker's load."""
    _, tail = _tail(cache, getattr(req, "rid", None))
    if tail is None or tail.device_indices is None or tail.state not in (TailState.ADMITTED, TailState.LOADING):
        return original(cache, req)
    import torch

    path = cache.tree_core.collect_full_device_indices(req.last_node, cache.root_node_handle(req.extra_key))
    path = torch.cat([path, tail.device_indices.to(path.dtype)])
    assert len(path) >= req.prefix_len, (req.rid, len(path), req.prefix_len)
    return path[: req.prefix_len]


# ---------------------------------------------------------------------------------------------- abort
def after_abort(result: Any, cache: Any, request: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``release_aborted_request``: a tail not yet loading is dropped; the request is forgotten."""
    registry, tail = _tail(cache, getattr(request, "rid", None))
    if registry is None:
        return None
    if tail is not None and tail.state in (TailState.REGISTERED, TailState.READY, TailState.ADMITTED):
        guard(cache, "abort", "tail kept", lambda: drop(cache, registry, tail, "abort"))
    registry.unblock(request.rid)
    return None


HOOKS: list[tuple[str, Any, str]] = [
    *stream_bind.HOOKS,
    (URC + "_handle_prefetch_result", register_tail, "AROUND"),
    (URC + "check_prefetch_progress", gate, "AROUND"),
    (URC + "_finalize_match_result", virtual_hit, "AFTER"),
    (URC + "init_load_back", load_back, "AROUND"),
    ("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", add_one_req, "AROUND"),
    (URC + "prefix_device_indices", prefix_device_indices, "AROUND"),
    (URC + "release_aborted_request", after_abort, "AFTER"),
]
