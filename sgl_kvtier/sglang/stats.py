"""Per-op transfer figures in SGLang's ``StorageMetrics`` shape, drained by the scheduler every step.

Invariant: ``drain`` hands each recorded op to SGLang exactly once (the lists are swapped under the lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang.srt.observability.metrics_collector import StorageMetrics


@dataclass
class TransferStats:
    """Pages and GB/s of each get / set batch since the last ``drain`` (SGLang's histograms read them)."""

    enabled: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _pending: StorageMetrics = field(default_factory=StorageMetrics, repr=False)

    def record_get(self, pages: int, page_bytes: int, seconds: float) -> None:
        """One read batch: ``pages`` of ``page_bytes`` in ``seconds``."""
        self._record(pages, page_bytes, seconds, lambda m: (m.prefetch_pgs, m.prefetch_bandwidth))

    def record_set(self, pages: int, page_bytes: int, seconds: float) -> None:
        """One write batch: ``pages`` of ``page_bytes`` in ``seconds``."""
        self._record(pages, page_bytes, seconds, lambda m: (m.backup_pgs, m.backup_bandwidth))

    def _record(self, pages: int, page_bytes: int, seconds: float,
                lists: Callable[[StorageMetrics], tuple[list[int], list[float]]]) -> None:
        if not self.enabled or pages == 0:
            return
        with self._lock:  # the lists are picked under the lock: a concurrent drain swaps them
            pgs, bw = lists(self._pending)
            pgs.append(pages)
            bw.append(pages * page_bytes / max(seconds, 1e-9) / 1e9)

    def drain(self) -> StorageMetrics:
        """Everything recorded since the last call; the next call starts empty."""
        with self._lock:
            out, self._pending = self._pending, StorageMetrics()
        return out
