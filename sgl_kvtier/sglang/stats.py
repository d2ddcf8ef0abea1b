"""Per-op transfer figures in SGLang's ``StorageMetrics`` shape, drained by the scheduler every step."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from sglang.srt.observability.metrics_collector import StorageMetrics


@dataclass
class TransferStats:
    enabled: bool = True
    errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _pending: StorageMetrics = field(default_factory=StorageMetrics, repr=False)

    def record_get(self, pages: int, page_bytes: int, seconds: float) -> None:
        self._record(pages, page_bytes, seconds, self._pending.prefetch_pgs, self._pending.prefetch_bandwidth)

    def record_set(self, pages: int, page_bytes: int, seconds: float) -> None:
        self._record(pages, page_bytes, seconds, self._pending.backup_pgs, self._pending.backup_bandwidth)

    def _record(self, pages: int, page_bytes: int, seconds: float, pgs: list, bw: list) -> None:
        if not self.enabled or pages == 0:
            return
        with self._lock:
            pgs.append(pages)
            bw.append(pages * page_bytes / max(seconds, 1e-9) / 1e9)

    def drain(self) -> StorageMetrics:
        with self._lock:
            out, self._pending = self._pending, StorageMetrics()
        return out
