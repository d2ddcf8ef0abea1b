"""A bandwidth- and latency-capping IO engine wrapper that emulates a slower device (benchmarks only).

Enabled by the store config table ``throttle`` (``config.ThrottleSpec``: ``read_bytes_per_s``,
``write_bytes_per_s``, absent: uncapped; ``latency_s``, default 0). One emulated device per store, shared by
every caller: at most ``depth`` ops in flight (an op is issued on arrival or when the earliest in flight
ends); one busy-until clock, each issued op occupying it for ``nbytes / rate`` after every op issued before
(reads and writes share it); latency added after the transfer, overlapping across ops in flight, so ``k <=
depth`` ops of ``n`` bytes issued together end after ``k * n / rate + latency`` (the cost model's shape).

Invariants: bytes, checksums and errors are the wrapped engine's; ``run`` returns no earlier than the
emulated completion of its last op; ``IOResult.seconds`` is the emulated issue-to-completion time (or the
real time if longer); failed ops are charged like good ones; the schedule is computed under one lock and
sleeping happens outside it.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

from sgl_kvtier.config import ThrottleSpec
from sgl_kvtier.io.ops import IOEngine, IOOp, IOResult, OpKind, op_length

log = logging.getLogger(__name__)
DEFAULT_DEPTH = 32  # the store's default io_depth, for a wrapped engine that does not say its own


def transfer_s(spec: ThrottleSpec, kind: OpKind, nbytes: int) -> float:
    """Seconds the emulated device's bandwidth is busy with ``nbytes`` of ``kind`` (0.0 when uncapped)."""
    rate = spec.read_bytes_per_s if kind is OpKind.READ else spec.write_bytes_per_s
    return nbytes / rate


class ThrottledEngine:
    """Wraps an ``IOEngine``; every op takes at least the time the emulated device would take."""

    def __init__(self, inner: IOEngine, settings: ThrottleSpec, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.inner = inner
        self.name = f"throttled({inner.name})"
        self.settings = settings
        self.depth = max(1, int(getattr(inner, "depth", DEFAULT_DEPTH)))
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._busy_until = -math.inf  # when the device's bandwidth is next free
        self._inflight: list[float] = []  # completion times of issued ops (a min-heap, at most depth long)
        self.waited_s = 0.0  # total time run() slept to reach the emulated completions (for reports)
        log.warning("throttled IO (emulating a slower device): %s, queue depth %d", self.settings, self.depth)

    def schedule(self, ops: Sequence[IOOp], now: float) -> list[tuple[float, float]]:
        """(issue, completion) of each op arriving at ``now``, in order; advances the device state."""
        out: list[tuple[float, float]] = []
        with self._lock:
            heap = self._inflight
            while heap and heap[0] <= now:
                heapq.heappop(heap)
            for op in ops:
                issue = now if len(heap) < self.depth else max(now, heapq.heappop(heap))
                start = max(issue, self._busy_until)
                self._busy_until = start + transfer_s(self.settings, op.kind, op_length(op))
                done = self._busy_until + self.settings.latency_s
                heapq.heappush(heap, done)
                out.append((issue, done))
        return out

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        """Run ``ops`` on the wrapped engine, returning no earlier than their emulated completion."""
        if not ops:
            return []
        plan = self.schedule(ops, self._clock())
        results = self.inner.run(ops)
        left = max(done for _, done in plan) - self._clock()
        if left > 0:
            self._sleep(left)  # the slow device being emulated
            with self._lock:
                self.waited_s += left
        for res, (issue, done) in zip(results, plan):
            res.seconds = max(res.seconds, done - issue)
        return results

    def close(self) -> None:
        """Close the wrapped engine."""
        self.inner.close()


__all__ = ["ThrottledEngine", "transfer_s"]
