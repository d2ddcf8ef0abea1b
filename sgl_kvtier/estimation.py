"""Measured models shared by the store (its read rates) and the cost model (load or recompute).

Stdlib only, no clock; it sits below both ``store`` and ``policy`` so neither imports the other.
``DeviceModel`` is a read path as a prefetch sees it (``T(n) = ceil(n / batch_pages) * batch_latency +
n * page_bytes / bandwidth``); ``DecayingLeastSquares`` non-negative least squares with weights halving
every ``half_life`` samples (not thread-safe: each estimator holds its own lock); ``TransferEstimator`` fits
``seconds ~= batch_latency + bytes / bandwidth`` over recent transfers and publishes a ``DeviceModel``.
Invariant: a fit never has a negative coefficient; a degenerate sample set falls back to fewer
coefficients, never to a negative speed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

STORAGE_BATCH_PAGES = 128  # SGLang's STORAGE_BATCH_SIZE (hicache_storage): pages per L3 batch (one ack)


@dataclass(frozen=True)
class DeviceModel:
    """The read path as a prefetch sees it: bandwidth in bytes/s (may be inf) and a fixed cost per batch."""

    bandwidth_Bps: float
    batch_latency_s: float

    def load_time(self, pages: int, page_bytes: int, batch_pages: int = STORAGE_BATCH_PAGES) -> float:
        """Seconds to load ``pages`` pages of ``page_bytes`` in batches of ``batch_pages``."""
        if pages <= 0:
            return 0.0
        return math.ceil(pages / batch_pages) * self.batch_latency_s + pages * page_bytes / self.bandwidth_Bps


def _solve(a: list[list[float]], r: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a (numerically) singular system."""
    n = len(r)
    m = [row[:] + [r[i]] for i, row in enumerate(a)]
    scale = max((abs(m[i][i]) for i in range(n)), default=0.0)
    if scale <= 0:
        return None
    for col in range(n):
        piv = max(range(col, n), key=lambda i: abs(m[i][col]))
        if abs(m[piv][col]) <= 1e-10 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for i in range(col + 1, n):
            f = m[i][col] / m[col][col]
            for j in range(col, n + 1):
                m[i][j] -= f * m[col][j]
    out = [0.0] * n
    for i in reversed(range(n)):
        out[i] = (m[i][n] - sum(m[i][j] * out[j] for j in range(i + 1, n))) / m[i][i]
    return out


class DecayingLeastSquares:
    """Non-negative least squares of y ~ theta . x over samples whose weights halve every ``half_life``.

    ``subsets`` are the coefficient index sets tried, in order of preference among equally good fits; the
    best feasible (all coefficients >= 0) subset solution is the exact NNLS optimum when every subset is
    listed.
    """

    def __init__(self, n: int, half_life: float, subsets: Sequence[tuple[int, ...]]):
        if not half_life > 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.n, self.subsets = n, subsets
        self.decay = 0.5 ** (1.0 / half_life)
        self.gram = [[0.0] * n for _ in range(n)]
        self.rhs = [0.0] * n
        self.yy = 0.0
        self.count = 0

    def add(self, x: Sequence[float], y: float) -> None:
        """One sample: features ``x`` (length ``n``) and the measured ``y``."""
        d = self.decay
        for i in range(self.n):
            self.rhs[i] = self.rhs[i] * d + x[i] * y
            for j in range(self.n):
                self.gram[i][j] = self.gram[i][j] * d + x[i] * x[j]
        self.yy = self.yy * d + y * y
        self.count += 1

    def solve(self) -> list[float] | None:
        """The coefficients (length ``n``, unused ones 0.0), or None while no subset is solvable."""
        best, best_res = None, math.inf
        tol = 1e-9 * self.yy
        for subset in self.subsets:
            sol = _solve([[self.gram[i][j] for j in subset] for i in subset], [self.rhs[i] for i in subset])
            if sol is None or any(v < 0 for v in sol):
                continue
            theta = [dict(zip(subset, sol)).get(i, 0.0) for i in range(self.n)]
            res = self.yy - 2 * sum(t * r for t, r in zip(theta, self.rhs)) + sum(
                theta[i] * self.gram[i][j] * theta[j] for i in range(self.n) for j in range(self.n))
            if res < best_res - tol:
                best, best_res = theta, res
        return best


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


__all__ = ["STORAGE_BATCH_PAGES", "DeviceModel", "DecayingLeastSquares", "TransferEstimator"]
