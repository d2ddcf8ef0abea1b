"""SGLang's storage-prefetch counters for streamed tails: a tail is not "unfulfilled" while it streams.

``UnifiedRadixCache._handle_prefetch_result`` resolves the part of a hit its op did not complete as unfulfilled
(``_resolve_storage_prefetch_tokens``, logged to ``sglang:storage_prefetch_unfulfilled_tokens_total``) before the
register step (``hooks.admit``) decides whether that part streams, and a Prometheus counter cannot be taken back.
So while the register step runs SGLang's body (``holding``), that resolution is made without its log (SGLang's
per-request accounting settles as before) and the tokens and reason are held. Not registered: the held log is
made at once (``release``). Registered: held on the tail (``hold``) until its outcome (``settle``): kept, the
tokens count as prefetched; dropped, poisoned or forgotten, as unfulfilled with the held reason.

Each tail settles at most once. Nothing is held with storage metrics off, or on a SGLang without the per-request
table this reads (``_storage_prefetch_hit_remaining_by_reqid``). Rank-local, as SGLang's own counters.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sgl_kvtier.experiments.streaming.contract import StreamedTail

RESOLVE_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._resolve_storage_prefetch_tokens"
REMAINING_ATTR = "_storage_prefetch_hit_remaining_by_reqid"

Held = list[tuple[int, str]]  # (tokens, SGLang's reason) of each resolution held back


class _Capture(threading.local):
    state: tuple[Any, Held] | None = None  # (the op's request handle, what was held) while ``holding``


_capture = _Capture()
_held: weakref.WeakKeyDictionary[StreamedTail, Held] = weakref.WeakKeyDictionary()


def collector(cache: Any) -> Any:
    """SGLang's storage metrics collector of ``cache`` (None: metrics off)."""
    if not getattr(cache, "enable_storage_metrics", False):
        return None
    return getattr(cache, "storage_metrics_collector", None)


@contextmanager
def holding(cache: Any, request: Any) -> Iterator[Held]:
    """While the block runs (this thread), ``request``'s unfulfilled resolutions are held, not logged."""
    held: Held = []
    outer = _capture.state
    _capture.state = None if collector(cache) is None else (request, held)
    try:
        yield held
    finally:
        _capture.state = outer


def resolve_quietly(original: Callable[..., Any], cache: Any, request: Any, num_tokens: int,
                    reason: str | None = None) -> Any:
    """AROUND ``_resolve_storage_prefetch_tokens``: inside ``holding`` for ``request``, the same resolution
    with no reason (no log) and the tokens SGLang would have logged held; anything else unchanged."""
    state = _capture.state
    table = getattr(cache, REMAINING_ATTR, None)
    if state is None or reason is None or state[0] is not request or not isinstance(table, dict):
        return original(cache, request, num_tokens, reason=reason)
    try:
        remaining = table.get(request)
        held = None if remaining is None or num_tokens <= 0 else (min(int(num_tokens), int(remaining)), reason)
    except (TypeError, ValueError):  # not SGLang's numbers: its own log stands (nothing raises into its thread)
        return original(cache, request, num_tokens, reason=reason)
    if held is not None:
        state[1].append(held)  # what SGLang would log (it caps at the remaining count too)
    return original(cache, request, num_tokens, reason=None)


def release(cache: Any, held: Held) -> None:
    """Not streamed: log what was held, as SGLang would have."""
    sink = collector(cache) if held else None
    if sink is not None:
        for tokens, reason in held:
            sink.log_storage_prefetch_unfulfilled_tokens(tokens, reason)


def hold(tail: StreamedTail, held: Held) -> None:
    """``tail`` was registered: its held resolution waits for its outcome."""
    if held:
        _held[tail] = list(held)


def settle(cache: Any, tail: StreamedTail, kept: bool) -> None:
    """``tail``'s outcome (at most once): kept, its tokens were prefetched; else they were unfulfilled."""
    held = _held.pop(tail, None)
    if not held:
        return
    if not kept:
        release(cache, held)
        return
    sink = collector(cache)
    if sink is not None:
        sink.log_prefetched_tokens(sum(tokens for tokens, _ in held))


HOOKS: list[tuple[str, Any, str]] = [(RESOLVE_TARGET, resolve_quietly, "AROUND")]

__all__ = ["HOOKS", "RESOLVE_TARGET", "collector", "hold", "holding", "release", "resolve_quietly", "settle"]
