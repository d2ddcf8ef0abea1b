"""A backend's streamed-hit state (``StreamingSide``): the binder of hits to host slots, the bind rule's
learned costs and the plugin's counters, attached to each ``KVTierStorage`` as an ``Extension``.

``install()`` (the stream plugin's ``load``, once its hooks registered) adds ``StreamingSide`` to
``sgl_kvtier.sglang.storage.EXTENSIONS``, so every backend made afterwards in this process carries one; a process
without the plugin makes none and its reads never pass through a binder. ``side_of(backend)`` finds it.

Invariants: the side holds its backend weakly (no reference cycle; ``store.lifecycle``); it streams only
with ``streaming = "on"`` on a KV pool whose pages stream in layer groups (``enabled``); ``bind_hit`` never
raises (a failure is counted at the backend's boundary and the hit loads whole); ``close`` closes the
binder, which the backend does before its stores (its streams read them).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from sgl_kvtier.config import Streaming
from sgl_kvtier.errors import KVTierError
from sgl_kvtier.experiments.streaming.binding import StreamBinder, StreamCounters, why_not_streaming
from sgl_kvtier.experiments.streaming.rules.bind import StreamCosts
from sgl_kvtier.keys import PageKey
from sgl_kvtier.sglang import storage
from sgl_kvtier.sglang.page_keys import keys_until_invalid
from sgl_kvtier.sglang.parts_plan import Cuts
from sgl_kvtier.telemetry.snapshot import StreamBindSnapshot, StreamHookSnapshot, StreamSnapshot

if TYPE_CHECKING:
    from sgl_kvtier.sglang.storage import KVTierStorage

log = logging.getLogger(__name__)


class StreamingSide:
    """One backend's streamed hits (an ``sgl_kvtier.sglang.storage.Extension``)."""

    def __init__(self, backend: KVTierStorage) -> None:
        shards, me = backend.host_shards, weakref.ref(self)  # weakly: no reference cycle through the binder
        self._backend = weakref.ref(backend)
        self.stream_costs = StreamCosts()  # the bind rule's learned figures (``rules.bind``)
        self.binder = StreamBinder(lambda: shards.kv, lambda: bool((side := me()) and side.enabled), backend.boundary)
        self._hooks: Callable[[], StreamHookSnapshot] | None = None
        self._said = False

    @property
    def enabled(self) -> bool:
        """``streaming = "on"`` and the KV pool's pages stream in layer groups (``binding.why_not_streaming``)."""
        backend = self._backend()
        return backend is not None and backend.config.streaming is Streaming.ON and \
            why_not_streaming(backend.kv, backend.shards) is None

    def answer(self, keys: Sequence[PageKey | None], host_indices: torch.Tensor) -> list[bool] | None:
        """Bound slots: the stream's head at once (``StreamBinder.answer``); None: not bound, read them."""
        return self.binder.answer(keys, host_indices)

    def pools_registered(self) -> None:
        """Once per backend: why ``streaming = "on"`` cannot stream on what was registered (layout, side pools)."""
        backend = self._backend()
        if self._said or backend is None or backend.config.streaming is not Streaming.ON or backend.kv is None:
            return
        why = why_not_streaming(backend.kv, backend.shards)
        if why:
            self._said = True
            log.warning("kvtier: streaming = \"on\" but L3 hits will load whole, as with \"off\": %s", why)

    def attach_hooks(self, counts: Callable[[], StreamHookSnapshot]) -> None:
        """Streaming is on for this backend: ``counts()`` reads the plugin's counters (``telemetry().stream``)."""
        self._hooks = counts

    def bind_hit(self, hashes: list[str], host_indices: torch.Tensor, cuts: Cuts | None = None) -> None:
        """SGLang allocated ``host_indices`` for the hit of ``hashes`` (its leading ``len(host_indices) //
        page_tokens`` pages; the allocation may be shorter than the hit): stream them in now, in the read
        groups ``cuts`` (``rules.read_groups``; None: the pool's layer groups). Never raises (a failure is
        counted at the boundary and the hit loads whole)."""
        backend = self._backend()
        if backend is None:
            return
        try:
            shard = backend.kv
            if not self.enabled or shard is None:
                return
            pages = host_indices.numel() // shard.pages.page_tokens
            keys = keys_until_invalid(hashes[:pages])
            if pages and len(keys) == pages:
                self.binder.bind(keys, host_indices, cuts)
        except Exception as exc:  # the boundary: nothing raises into SGLang's threads
            backend.boundary.fail("bind_hit", exc)

    def snapshot(self) -> StreamSnapshot | None:
        """The binder's and the plugin's counters and the bind rule's figures (None: not streaming)."""
        backend = self._backend()
        if backend is None or not self.enabled:
            return None
        hooks = None
        if self._hooks is not None:
            try:
                hooks = self._hooks()
            except Exception as exc:  # the rest of the snapshot stands
                backend.boundary.fail("telemetry (stream plugin counters)", exc, outcome="reported without them")
        model = backend.cost.prefill.model()
        return stream_snapshot(self.binder.counts(), hooks,
                               self.stream_costs.snapshot(None if model is None else model.batch_time))

    def close(self) -> None:
        """Cancel and end every bound stream (idempotent)."""
        self.binder.close()


def side_enabled(backend: Any) -> bool:
    """Whether ``backend`` carries a streaming side that streams."""
    side = side_of(backend)
    return side is not None and side.enabled


def side_of(backend: Any) -> StreamingSide | None:
    """``backend``'s streaming side (None: a backend made without the stream plugin, or no backend)."""
    for ext in getattr(backend, "extensions", ()):
        if isinstance(ext, StreamingSide):
            return ext
    return None


def require_side(backend: Any) -> StreamingSide:
    """``backend``'s streaming side; ``KVTierError`` when it has none (callers run under a guard)."""
    side = side_of(backend)
    if side is None:
        raise KVTierError("this backend carries no streaming side (made before the stream plugin loaded)")
    return side


def install() -> None:
    """Every backend made from now on in this process carries a ``StreamingSide`` (idempotent)."""
    if StreamingSide not in storage.EXTENSIONS:
        storage.EXTENSIONS.append(StreamingSide)


def stream_snapshot(counts: StreamCounters, hooks: StreamHookSnapshot | None,
                    bind: StreamBindSnapshot | None = None) -> StreamSnapshot:
    """The binder's counters (``StreamBinder.counts``), the stream plugin's (None: not active) and the bind
    rule's learned figures, typed."""
    return StreamSnapshot(
        bound_hits=counts.streams_bound, read_groups=counts.read_groups, head_pages=counts.head_pages,
        streamed_pages=counts.streamed_pages, staged_pages=counts.staged_pages, failed_pages=counts.failed_pages,
        failed_groups=counts.failed_groups, cancelled=counts.cancelled_streams, read_errors=counts.stream_errors,
        withheld_pages=counts.withheld_pages, mismatches=counts.mismatches, hooks=hooks, bind=bind)


__all__ = ["StreamCounters", "StreamingSide", "install", "require_side", "side_enabled", "side_of", "stream_snapshot"]
