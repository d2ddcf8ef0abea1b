"""The records the parts of a streamed L3 tail share: who owns what, when, and the crash rules.

Life of one hit (SGLang calls on the scheduler thread unless named otherwise):

1. **Bind** (AFTER ``HybridCacheController.allocate_storage_hit``, before SGLang queues the op for its IO
   thread): ``StreamingSide.bind_hit`` starts a ``TailStream`` reading every page of the hit group-major
   (read group 0 of every page, verified, then group 1, ...) straight into the allocated host slots; pages
   that read-ahead staged are copied in whole.
2. **Head / tail** (SGLang's IO thread, ``batch_get_v1``): for bound slots the backend answers at once, never
   blocking: True for the leading pages whose every group landed verified (the stream never writes their
   slots again), False from the first that has not. SGLang inserts that head into the tree.
3. **Register** (AROUND ``UnifiedRadixCache._handle_prefetch_result``): the rest becomes a ``StreamedTail``
   (REGISTERED) in the cache's ``StreamRegistry``. Its host slots are **withheld** from SGLang's release and
   freed by us only once the stream's IO has ended (``defer_free`` / ``reap``).
4. **Admit** (the T_hide gate, AROUND ``UnifiedRadixCache.check_prefetch_progress``): READY once the rest of
   the read is predicted to hide under the suffix's compute; the match then reports the tail as a host hit and
   ``init_load_back`` allocates device slots private to the request (ADMITTED, queued).
5. **Load** (``ready_to_load_host_cache`` .. the forward, LOADING): a loader copies each group's layers from
   the host slots to the device slots once ``stream.wait_group`` says LANDED, else writes zeros there; the
   forward's per-layer wait blocks until that layer's group is done.
6. **Verdict** (AFTER ``Scheduler.run_batch``): rank-MIN of "landed". Landed: DONE, the KV is the request's
   own and is inserted like computed KV. Else POISONED: the forward's output is discarded and the request
   recomputes. Either way the host slots are freed once the stream ended.

Invariants:
- A tail's host slot is written only by its stream and freed only after ``stream.ended`` (never freed, nor
  reused, while a read may still land in it).
- A tail's device slots are written only by the loader, after their group verified (or with zeros); they are
  request-owned KV (``cache_protected_len`` excludes the tail) and reach the tree only through the request's
  own insert after a good forward.
- Every decision that changes what SGLang sees (register, admit, verdict, frees of withheld slots) is taken
  at a lockstep scheduler-thread point and MIN-reduced over the ranks (``cache._all_reduce``).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class GroupVerdict(enum.Enum):
    """The answer to "has layer group g landed on these pages?"."""

    LANDED = "landed"  # read and verified in the host slots of every page asked about
    FAILED = "failed"  # some page failed a part of it (IO error, checksum), or the stream was cancelled
    TIMEOUT = "timeout"  # not yet, within the time given


class TailStream(Protocol):
    """One bound hit's pages, streaming group-major into its host slots (``tail_stream.TailStream``).

    Thread-safe: ``wait_group`` and ``landed_pages`` may be called from any thread while reads run."""

    @property
    def pages(self) -> int: ...  # pages of the bound hit

    @property
    def groups(self) -> int: ...  # read groups per page: the pool's layer groups, or fewer merged from them

    @property
    def host_indices(self) -> torch.Tensor: ...  # the bound slots (pages * page_tokens)

    def layers(self, group: int) -> range: ...  # the pool's layers in ``group`` (ascending, disjoint)

    def landed_pages(self) -> int: ...  # leading pages with every group landed and verified

    def wait_group(self, group: int, first_page: int, timeout: float | None) -> GroupVerdict: ...

    def remaining_bytes(self, first_page: int) -> int: ...  # bytes of pages >= first_page still to land

    def read_rate(self) -> float | None: ...  # bytes/s this stream has landed so far (None: too early)

    def rate_settled(self) -> bool: ...  # read_rate counts between landings (False: from the thread's start)

    def cancel(self) -> None: ...  # issue no more IO (reads in flight still land)

    @property
    def ended(self) -> bool: ...  # no IO in flight into the slots, none will be issued

    def wait_ended(self, timeout: float | None = None) -> bool: ...


class TailState(enum.Enum):
    """Where a ``StreamedTail`` is in its life (module docstring); changed on the scheduler thread only."""

    REGISTERED = "registered"  # head inserted, tail streaming, request waiting at the T_hide gate
    READY = "ready"  # the gate opened: the next match reports the tail as a host hit
    ADMITTED = "admitted"  # private device slots allocated, load queued for the next batch
    LOADING = "loading"  # the loader copies groups while the forward runs
    DONE = "done"  # the forward ran on verified KV: the tail is the request's own KV now
    POISONED = "poisoned"  # a group was zero-filled: the forward's output must be discarded
    DROPPED = "dropped"  # given up before admission (head evicted, no device room, abort, reset)


@dataclass(eq=False)
class StreamedTail:
    """One request's tail. ``token_start`` is the tail's first position in the request's token sequence
    (the head's end); the tail covers ``pages[first_page:]`` of ``stream``, ``tokens`` positions."""

    rid: str
    stream: TailStream
    first_page: int
    token_start: int
    tokens: int
    host_indices: torch.Tensor  # the withheld host slots of the tail (stream slots from first_page on)
    hashes: tuple[str, ...]  # SGLang's storage hashes of the tail's pages
    state: TailState = TailState.REGISTERED
    device_indices: torch.Tensor | None = None  # private device slots, set at init_load_back
    failed_groups: list[int] = field(default_factory=list)  # groups zero-filled by the loader

    @property
    def token_end(self) -> int:
        return self.token_start + self.tokens


class StreamRegistry:
    """The tails of one ``UnifiedRadixCache`` (one per scheduler process), plus withheld slots waiting
    for their stream to end. Scheduler thread only, except ``defer_free`` (any thread)."""

    def __init__(self) -> None:
        self._tails: dict[str, StreamedTail] = {}
        self._queued: list[StreamedTail] = []  # ADMITTED, to be loaded by the next batch
        self._deferred: list[tuple[TailStream, torch.Tensor]] = []
        self._blocked: set[str] = set()  # requests retracted after a failed tail: never stream again
        self._lock = threading.Lock()  # guards _deferred only

    def register(self, tail: StreamedTail) -> None:
        if tail.rid in self._tails:
            raise ValueError(f"request {tail.rid} already has a streamed tail")
        self._tails[tail.rid] = tail

    def get(self, rid: str) -> StreamedTail | None:
        return self._tails.get(rid)

    def __iter__(self) -> Iterator[StreamedTail]:
        return iter(list(self._tails.values()))

    def __len__(self) -> int:
        return len(self._tails)

    def block(self, rid: str) -> None:
        """``rid`` was retracted after a failed tail: its retry loads its hit whole (verified before
        admission) or recomputes it, never streams (no retract loop). Forgotten with ``unblock``."""
        self._blocked.add(rid)

    def is_blocked(self, rid: str) -> bool:
        return rid in self._blocked

    def unblock(self, rid: str) -> None:
        """The request finished or was aborted: forget it."""
        self._blocked.discard(rid)

    def queue_load(self, tail: StreamedTail) -> None:
        tail.state = TailState.ADMITTED
        self._queued.append(tail)

    def take_queued(self) -> list[StreamedTail]:
        """The ADMITTED tails of the batch being started (now LOADING)."""
        taken, self._queued = self._queued, []
        for tail in taken:
            tail.state = TailState.LOADING
        return taken

    def remove(self, rid: str) -> StreamedTail | None:
        """Forget ``rid``'s tail; its host slots go to ``defer_free`` (the caller's job)."""
        tail = self._tails.pop(rid, None)
        if tail is not None:
            self._queued = [t for t in self._queued if t is not tail]
        return tail

    def defer_free(self, stream: TailStream, host_indices: torch.Tensor) -> None:
        """Free ``host_indices`` once ``stream`` has ended (``reap``)."""
        if len(host_indices):
            with self._lock:
                self._deferred.append((stream, host_indices))

    def deferred(self) -> int:
        with self._lock:
            return len(self._deferred)

    def reap(self, count: int | None = None) -> list[torch.Tensor]:
        """Slots now safe to free: those of the leading deferred entries whose stream ended (at most
        ``count`` entries: the rank-MIN of ``ready_to_reap()``, so every rank frees the same slots)."""
        with self._lock:
            out: list[torch.Tensor] = []
            while self._deferred and (count is None or len(out) < count) and self._deferred[0][0].ended:
                out.append(self._deferred.pop(0)[1])
            return out

    def take_deferred(self) -> list[tuple[TailStream, torch.Tensor]]:
        """Every deferred entry, ended or not, out of the registry (reset / detach: the caller waits for each
        stream's end, then frees or forgets its slots)."""
        with self._lock:
            taken, self._deferred = self._deferred, []
            return taken

    def ready_to_reap(self) -> int:
        """How many leading deferred entries have ended (the local count to MIN-reduce before ``reap``)."""
        with self._lock:
            n = 0
            for stream, _ in self._deferred:
                if not stream.ended:
                    break
                n += 1
            return n
