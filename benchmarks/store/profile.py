"""Where a store's put and get time goes, phase by phase: ``bench_store --profile``.

``PhaseProfile`` wraps, for the duration of a ``with`` block, the phases of one open ``PageStore`` (instance
attributes: put's reserve / write / publish / persist, get's pin / read / settle, the data fdatasync and
the engine run inside them) and the IO engines' per-op steps (module attributes of ``io.ops`` and
``io.uring``: digests and trailer before a write, the syscall, digests after a read). Caller-thread phases
are wall seconds; the per-op steps run on the IO threads and are summed over them (thread-seconds), so they
can exceed the wall time of the phase holding them. The wrappers cost about a microsecond a call: the
profiled passes are a little slower than unprofiled ones. Nothing in the store changes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from sgl_kvtier.io import ops, uring

# (label, owner path from the store, attribute): caller-thread phases, in the order a batch runs them
STORE_PHASES = (
    ("put: reserve (lock: admit, slots, evict)", "", "_reserve"),
    ("put: write (phase total)", "", "_write"),
    ("  engine run (IO + digests)", "_io", "_run"),
    ("put:   data fdatasync", "_io", "_sync_data"),
    ("put: publish (lock: journal append, index)", "", "_publish"),
    ("put: persist (journal fsync, checkpoint)", "", "_persist"),
    ("get: pin (lock: lookup, pin)", "", "_pin"),
    ("get: read (phase total)", "_io", "read_timed"),
    ("get: settle (lock: counters)", "", "_settle"),
)
# (label, module attribute): per-op steps on the IO threads
OP_STEPS = (
    ("io thread: write digests + trailer", "prepare_write"),
    ("io thread: pwritev/preadv syscalls", "_transfer"),
    ("io thread: read digests (verify)", "read_digests"),
)


class PhaseProfile:
    """Seconds and calls per phase while active (see the module docstring); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def _add(self, label: str, seconds: float) -> None:
        with self._lock:
            self.seconds[label] = self.seconds.get(label, 0.0) + seconds
            self.calls[label] = self.calls.get(label, 0) + 1

    def _timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(label, time.perf_counter() - t0)
        return call

    @contextmanager
    def active(self, store: Any) -> Iterator[PhaseProfile]:
        """Wrap ``store``'s phases and the engines' per-op steps until the block ends (then restored)."""
        with ExitStack() as undo:
            for label, owner_path, attr in STORE_PHASES:
                owner = getattr(store, owner_path) if owner_path else store
                setattr(owner, attr, self._timed(label, getattr(owner, attr)))
                undo.callback(delattr, owner, attr)  # the instance attribute goes: the class's method again
            for label, attr in OP_STEPS:
                for module in (ops, uring):
                    if hasattr(module, attr):
                        original = getattr(module, attr)
                        setattr(module, attr, self._timed(label, original))
                        undo.callback(setattr, module, attr, original)
            yield self

    def rows(self, batches: int, pages: int, wall_s: float) -> list[dict[str, Any]]:
        """One dict per phase seen in the profiled pass (one op's: puts or gets): seconds, calls, ms per
        batch, us per page, and share of the pass's wall time ``wall_s``."""
        out = []
        for label in [p[0] for p in STORE_PHASES] + [s[0] for s in OP_STEPS]:
            if label in self.seconds:
                s = self.seconds[label]
                out.append({"phase": label, "seconds": s, "calls": self.calls[label],
                            "ms_per_batch": s / batches * 1e3, "us_per_page": s / pages * 1e6,
                            "share": s / wall_s if wall_s > 0 else None})
        return out
