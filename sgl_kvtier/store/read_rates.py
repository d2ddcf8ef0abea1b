"""A shard's measured read path: bandwidth and per-batch latency, fitted over its real ``get`` batches.

Each ``TransferEstimator`` (``sgl_kvtier.estimation``) fits ``seconds ~= batch_latency + bytes / bandwidth``
by moving least squares (weights halving every ``half_life`` samples) and publishes an immutable
``DeviceModel`` after every sample. ``ReadRates`` keeps one for all devices of a shard together (``total``,
fitted on each batch's wall clock: what a load waits for) and one per device (fitted on the bytes it
delivered and the seconds its own ops were busy, ``store.transfer.busy_seconds``, so a slow device reads slower
than a fast one in the same batch; the batch's wall clock where its ops were not timed). Thread-safe: each
estimator has its own lock. The cost model (``policy.cost_model``) consumes the ``DeviceModel``; neither
side imports the other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from sgl_kvtier.estimation import DeviceModel, TransferEstimator


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
