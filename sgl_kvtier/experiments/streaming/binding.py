"""The backend's table of bound hits: which host slots a ``TailStream`` is writing, and ``batch_get_v1``'s
non-blocking head/tail answer for them.

One ``StreamBinder`` per backend (``StreamingSide.binder``). ``bind(keys, host_indices)`` (scheduler thread, right
after SGLang allocated the hit's host slots) starts a stream and indexes its pages by host page (``slot //
page_tokens``: SGLang's host pages are runs of ``page_tokens`` slots from a page-aligned slot, as
``get_page_buffer_meta`` assumes). Each entry is ``(bound stream, page offset in it)``.

Who removes what (the index only shrinks, except at ``bind``):
- ``answer`` (SGLang's IO thread): for a slice that is a run of one bound stream's pages, True for its leading
  pages that landed, False from the first that has not; never waits. A stream whose every page was answered
  True leaves the index. A slice that overlaps bound pages without being such a run, or whose keys differ from
  the stream's, is a bug: those streams are cancelled and leave the index; the answer is None (the backend reads
  the pages itself) once they ended, or all False if one does not end in time (no read may land under theirs).
- ``take`` (the plugin, registering a tail): the stream leaves the index; the plugin owns it.
- ``claim_released`` (the plugin, before SGLang releases host slots): released pages leave the index; a released
  page the stream may still write (not settled) is withheld, and its stream cancelled.
- ``bind`` on pages still indexed: entries of settled pages or ended streams are stale and dropped; an unsettled
  one means SGLang reused slots under a stream (a bug): that stream is cancelled and waited for (bounded)
  before the new one is bound, or the new hit is not bound.
- ``close``: every stream this binder started (taken ones too) is cancelled, then waited for (bounded).

The binder's lock guards the index and the counters and is never held while waiting for a stream. What is
local here (landed and settled pages) differs between TP ranks; the plugin makes every decision SGLang sees
rank-consistent (``contract``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from sgl_kvtier.errors import KVTierError
from sgl_kvtier.experiments.streaming.rules.read_groups import Cuts
from sgl_kvtier.experiments.streaming.tail_stream import Observer, TailStream
from sgl_kvtier.io.threads import io_thread_started
from sgl_kvtier.keys import PageKey
from sgl_kvtier.sglang.host_pages import Access, check_indices
from sgl_kvtier.sglang.host_shard import HostShard
from sgl_kvtier.telemetry.counters import ErrorBoundary

log = logging.getLogger(__name__)

MAX_STREAMS = 2  # streams reading at once (executor threads); later ones queue
WAIT_S = 10.0  # bound on waiting for a cancelled stream to end (bug paths and close)


def why_not_streaming(kv: HostShard | None, tiers: Mapping[str, HostShard]) -> str | None:
    """Why a backend with ``streaming = "on"`` cannot stream its KV pool's hits (None: it can): the pool's
    pages must stream in layer groups (``HostPages.plan``), move zero-copy, be stored as those groups'
    checksummed parts, and be the only pool served (no side pools)."""
    if kv is None:
        return "no KV host pool is registered"
    plan = kv.pages.plan
    if plan is None:
        return f"the host layout {kv.pages.layout} does not stream in layer groups"
    if kv.pages.access is not Access.ZERO_COPY:
        return "the KV pool's pages are copied, not read in place"
    if kv.namespace.parts != plan.parts:
        return "the KV shard's checksummed parts are not the pool's layer groups"
    others = sorted(name for name in tiers if name != kv.name)
    if others:
        return f"side pools are served too ({', '.join(others)})"
    return None


@dataclass
class StreamCounters:
    """Streamed hits of one backend since it started (``StreamBinder.counts`` copies them)."""

    streams_bound: int = 0
    read_groups: int = 0  # read groups of the bound streams, summed (``TailStream.groups``: / streams_bound = mean)
    head_pages: int = 0  # pages ``batch_get_v1`` answered True from a stream (SGLang's head)
    streamed_pages: int = 0  # pages streams landed whole and verified (group-major or staged)
    staged_pages: int = 0  # ... of which copied from read-ahead staging
    failed_pages: int = 0  # pages of streams that did not land (not counting cancelled streams)
    failed_groups: int = 0  # (stream, layer group) pairs that did not land on every page of the stream
    cancelled_streams: int = 0
    stream_errors: int = 0  # streams whose read raised (also on the boundary)
    withheld_pages: int = 0  # released pages handed back to the plugin to free once their stream ended
    mismatches: int = 0  # answers or binds that found a stream where none was expected (bugs)


@dataclass(eq=False)
class _Bound:
    stream: TailStream
    pages: dict[int, int] = field(default_factory=dict)  # host page -> page offset, still indexed
    answered: int = 0  # leading pages answered True


class StreamBinder:
    """Bound hits of one backend by host page (module docstring)."""

    def __init__(self, tier: Callable[[], HostShard | None], enabled: Callable[[], bool], boundary: ErrorBoundary,
                 max_streams: int = MAX_STREAMS, wait_s: float = WAIT_S):
        self._tier = tier
        self._enabled = enabled
        self._boundary = boundary
        self._max_streams = max_streams
        self._wait_s = wait_s
        self.observer: Observer | None = None  # given to each new stream (tests, tracing)
        self._lock = threading.Lock()
        self._index: dict[int, tuple[_Bound, int]] = {}  # host page -> (bound stream, page offset)
        self._live: set[TailStream] = set()  # started, not ended (taken ones too)
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self._counters = StreamCounters()

    # ------------------------------------------------------------------ bind (scheduler thread)
    def bind(self, keys: Sequence[PageKey], host_indices: torch.Tensor,
             cuts: Cuts | None = None) -> TailStream | None:
        """Start a ``TailStream`` of ``keys`` into ``host_indices`` in the read groups ``cuts``
        (``rules.read_groups``; None: the pool's layer groups); None when streaming is off or the hit empty."""
        if not keys or not self._enabled():
            return None
        tier = self._tier()
        if tier is None:
            return None
        ps = tier.pages.page_tokens
        problem = check_indices(host_indices, len(keys), ps)
        if problem is not None:
            raise ValueError(problem)
        hpages = (host_indices[::ps] // ps).tolist()
        with self._lock:
            if self._closed:
                return None
            stale = self._unbind_pages(hpages)
        if any(not self._ended_after_cancel(s) for s in stale):
            return None
        with self._lock:
            if self._closed:
                return None
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._max_streams, thread_name_prefix="kvtier-stream",
                                                    initializer=io_thread_started)
            stream = TailStream(tier, keys, host_indices, self._executor, self._boundary, self.observer,
                                on_end=self._ended, cuts=cuts)
            bound = _Bound(stream, {hp: i for i, hp in enumerate(hpages)})
            for i, hp in enumerate(hpages):
                self._index[hp] = (bound, i)
            self._live.add(stream)
            self._counters.streams_bound += 1
            self._counters.read_groups += stream.groups
        stream.start()  # outside the lock: a refused start ends the stream, which takes the lock
        return stream

    def _unbind_pages(self, hpages: list[int]) -> list[TailStream]:
        """Under the lock: drop the index entries of ``hpages``; the streams that may still write them."""
        live: list[TailStream] = []
        for hp in hpages:
            found = self._index.pop(hp, None)
            if found is None:
                continue
            bound, page = found
            bound.pages.pop(hp, None)
            if not bound.stream.page_settled(page) and bound.stream not in live:
                live.append(bound.stream)
        if live:
            self._counters.mismatches += 1
        return live

    def _ended_after_cancel(self, stream: TailStream) -> bool:
        """A stream found writing slots it should not: cancel it and wait (bounded) for its end."""
        self._boundary.fail("stream binding", KVTierError("host slots in use by a tail stream were reused"),
                            outcome="that stream cancelled")
        self._drop(stream)
        stream.cancel()
        return stream.wait_ended(self._wait_s)

    # ------------------------------------------------------------------ answer (SGLang's IO thread)
    def answer(self, keys: Sequence[PageKey | None], host_indices: torch.Tensor) -> list[bool] | None:
        """``batch_get_v1``'s answer for bound slots, without waiting (module docstring); None: not bound."""
        if not self._index or not keys:  # the common case (streaming off or idle): no lock, no tensor work
            return None
        tier = self._tier()
        if tier is None or check_indices(host_indices, len(keys), tier.pages.page_tokens) is not None:
            return None  # not slots of ours to judge: the backend's own read answers (and reports) it
        ps = tier.pages.page_tokens
        hpages = (host_indices[::ps] // ps).tolist()
        with self._lock:
            found = [self._index.get(hp) for hp in hpages]
            first = found[0]
            run = first is not None and all(
                f is not None and f[0] is first[0] and f[1] == first[1] + i for i, f in enumerate(found))
            if first is not None and run:
                bound, offset = first
                if tuple(keys) == bound.stream.keys[offset:offset + len(keys)]:
                    return self._answer_run(bound, offset, len(keys), tier.pages.page_bytes)
            suspects = list({id(f[0]): f[0] for f in found if f is not None and not self._stale(*f)}.values())
            if not suspects:
                for hp, f in zip(hpages, found):  # stale entries only: forget them
                    if f is not None:
                        self._index.pop(hp, None)
                        f[0].pages.pop(hp, None)
                return None
            self._counters.mismatches += 1
            for bound in suspects:
                self._unindex(bound)
        self._boundary.fail("batch_get_v1 stream answer",
                            KVTierError(f"{len(keys)} pages overlap {len(suspects)} tail stream(s) they do not "
                                        f"match"), outcome="stream cancelled, read as today")
        ended = True
        for bound in suspects:
            bound.stream.cancel()
            ended = bound.stream.wait_ended(self._wait_s) and ended
        return None if ended else [False] * len(keys)

    def _answer_run(self, bound: _Bound, offset: int, n: int, page_bytes: int) -> list[bool]:
        """Under the lock: the head/tail answer of pages ``offset .. offset + n`` of ``bound``."""
        heads = max(0, min(n, bound.stream.landed_pages() - offset))
        bound.answered = max(bound.answered, offset + heads)
        self._counters.head_pages += heads
        if bound.answered == bound.stream.pages:  # every page answered True: nothing left to withhold
            self._unindex(bound)
        return [True] * heads + [False] * (n - heads)

    def _stale(self, bound: _Bound, page: int) -> bool:
        return bound.stream.page_settled(page)

    # ------------------------------------------------------------------ take / release (scheduler thread)
    def take(self, host_indices: torch.Tensor) -> TailStream | None:
        """The stream bound at the first page of ``host_indices``, out of the index: the caller owns it."""
        tier = self._tier()
        if tier is None or not isinstance(host_indices, torch.Tensor) or host_indices.numel() == 0:
            return None
        hp = int(host_indices[0]) // tier.pages.page_tokens
        with self._lock:
            found = self._index.get(hp)
            if found is None:
                return None
            self._unindex(found[0])
            return found[0].stream

    def claim_released(self, host_indices: torch.Tensor) -> tuple[torch.Tensor, list[tuple[TailStream, torch.Tensor]]]:
        """SGLang is about to release ``host_indices``: the slots it may release now, and per stream that may
        still write some of them, those slots (withheld: free them once that stream ended), after
        cancelling it. Released pages leave the index."""
        tier = self._tier()
        if not self._index or tier is None or host_indices.numel() == 0:
            return host_indices, []
        ps = tier.pages.page_tokens
        hpage_of_slot = host_indices // ps
        withheld: dict[int, tuple[_Bound, list[int]]] = {}  # id(bound) -> (bound, host pages to withhold)
        with self._lock:
            for hp in torch.unique(hpage_of_slot).tolist():
                found = self._index.pop(hp, None)
                if found is None:
                    continue
                bound, page = found
                bound.pages.pop(hp, None)
                if not bound.stream.page_settled(page):
                    withheld.setdefault(id(bound), (bound, []))[1].append(hp)
            for bound, hps in withheld.values():
                self._counters.withheld_pages += len(hps)
                for hp2, page in list(bound.pages.items()):  # its settled pages need no guard any more
                    if bound.stream.page_settled(page):
                        del bound.pages[hp2]
                        self._index.pop(hp2, None)
        keep = torch.ones(host_indices.numel(), dtype=torch.bool)
        out: list[tuple[TailStream, torch.Tensor]] = []
        for bound, hps in withheld.values():
            bound.stream.cancel()  # before the slots are handed over: no new IO into them from now on
            mask = torch.isin(hpage_of_slot, torch.tensor(hps, dtype=hpage_of_slot.dtype))
            keep &= ~mask
            out.append((bound.stream, host_indices[mask]))
        return (host_indices if not out else host_indices[keep]), out

    # ------------------------------------------------------------------ state
    def counts(self) -> StreamCounters:
        """A consistent copy of the counters."""
        with self._lock:
            return dataclasses.replace(self._counters)

    def bound_pages(self) -> int:
        """Host pages indexed now."""
        with self._lock:
            return len(self._index)

    def live_streams(self) -> int:
        """Streams started and not ended (taken ones too)."""
        with self._lock:
            return len(self._live)

    def close(self) -> None:
        """Cancel every stream this binder started, wait (bounded) for their end; later binds bind nothing."""
        with self._lock:
            self._closed = True
            live = list(self._live)
            self._index.clear()
            executor, self._executor = self._executor, None
        for stream in live:
            stream.cancel()
        late = [s for s in live if not s.wait_ended(self._wait_s)]
        if late:
            log.warning("kvtier: %d tail stream(s) still reading %.0f s after close", len(late), self._wait_s)
        if executor is not None:
            executor.shutdown(wait=not late, cancel_futures=True)

    # ------------------------------------------------------------------ internals
    def _unindex(self, bound: _Bound) -> None:
        """Under the lock: every page of ``bound`` out of the index."""
        for hp in bound.pages:
            if self._index.get(hp, (None, 0))[0] is bound:
                del self._index[hp]
        bound.pages.clear()

    def _drop(self, stream: TailStream) -> None:
        with self._lock:
            for bound, _ in list(self._index.values()):
                if bound.stream is stream:
                    self._unindex(bound)
                    break

    def _ended(self, stream: TailStream) -> None:
        summary = stream.summary()
        with self._lock:
            self._live.discard(stream)
            c = self._counters
            c.streamed_pages += summary.landed
            c.staged_pages += summary.staged
            c.cancelled_streams += summary.cancelled
            c.stream_errors += summary.error
            if not summary.cancelled:
                c.failed_pages += summary.failed_pages
                c.failed_groups += summary.failed_groups
