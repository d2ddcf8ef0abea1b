"""The store's measured read path: bandwidth and per-batch latency, fitted over its real ``get`` batches.

``TransferEstimator`` fits ``seconds ~= batch_latency + bytes / bandwidth`` (moving least squares, weights
halving every ``half_life`` samples) and publishes an immutable ``DeviceModel`` after every sample.
``ReadRates`` keeps one for all devices of a shard together and one per device:

- ``total`` is fitted on each batch's wall clock: that is what a load waits for.
- a device's estimator is fitted on the bytes it delivered and the seconds *it* was busy with them (its
  own ops' timings, ``transfer.busy_seconds``), so a slow device reads slower than a fast one in the same
  batch; where its ops were not timed (an engine that measures nothing), on the batch's wall clock.

Thread-safe: each estimator has its own lock. The cost model (``policy.cost_model``) consumes the
``DeviceModel``; neither side imports the other (both import ``sgl_kvtier.estimation``).
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from sgl_kvtier.estimation import DecayingLeastSquares, DeviceModel


class TransferEstimator:
    """seconds ~= batch_latency + bytes / bandwidth, fitted over recent real transfers (moving average)."""

    def __init__(self, half_life: float = 32.0):
        self._ls = DecayingLeastSquares(2, half_life, ((0, 1), (0,), (1,)))
        self._lock = threading.Lock()
        self._model: DeviceModel | None = None

    def record(self, nbytes: int, seconds: float) -> None:
        """One transfer of ``nbytes`` that took ``seconds``; empty or untimed transfers are ignored."""
        if nbytes <= 0 or not 0 < seconds < math.inf:
            return
        with self._lock:
            self._ls.add((nbytes / 1e6, 1.0), seconds)
            theta = self._ls.solve()
            if theta is not None:
                self._model = DeviceModel(1e6 / theta[0] if theta[0] > 0 else math.inf, theta[1])

    @property
    def samples(self) -> int:
        """How many transfers were recorded."""
        return self._ls.count

    def model(self) -> DeviceModel | None:
        """The current fit, or None before the first sample."""
        return self._model

    def snapshot(self) -> dict[str, Any]:
        """The fit as JSON-ready figures (None where not measured yet)."""
        m = self._model
        return {"bandwidth_Bps": None if m is None else m.bandwidth_Bps,
                "batch_latency_s": None if m is None else m.batch_latency_s, "samples": self.samples}


class ReadRates:
    """Read figures of one page store: all its devices together (what a load sees) and each device alone."""

    def __init__(self, devices: int, half_life: float = 32.0):
        self.total = TransferEstimator(half_life)
        self.devices = [TransferEstimator(half_life) for _ in range(devices)]

    def record(self, device_of_page: Sequence[int], page_bytes: int, seconds: float,
               device_seconds: Sequence[float] | None = None) -> None:
        """One read batch: the device of each page delivered, the batch's wall clock, and optionally each
        device's busy seconds (indexed by device; 0 or missing: not measured)."""
        self.total.record(len(device_of_page) * page_bytes, seconds)
        for d, n in Counter(device_of_page).items():
            if 0 <= d < len(self.devices):
                own = device_seconds[d] if device_seconds is not None and d < len(device_seconds) else 0.0
                self.devices[d].record(n * page_bytes, own if own > 0 else seconds)

    def model(self) -> DeviceModel | None:
        """The read model of the whole shard (``total``'s fit)."""
        return self.total.model()


__all__ = ["TransferEstimator", "ReadRates"]
