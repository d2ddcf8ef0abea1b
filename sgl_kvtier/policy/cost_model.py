"""Load or recompute: a per-request TTFT model for L3 prefix pages, and the prefill estimator that feeds it.

Pure Python: no clock, no SGLang, nothing of the store; callers pass measured inputs and elapsed times.
Modelled: SGLang's scheduler (``get_new_batch_prefill``) skips a request while ``check_prefetch_progress``
says its storage prefetch is in flight, so its prefill starts once the stop policy ends the prefetch. Pages
move in batches of ``batch_pages`` (SGLang's ``STORAGE_BATCH_SIZE``, one ack each); a cut keeps the completed
batches and wastes the one in flight. Loading the first ``k`` of ``H`` hit pages of ``P`` tokens:

    TTFT(k) ~= wait(k) + prefill(tokens=(H - k) * P + tail, cached=cached + k * P)
    load    T(n) = ceil(n / batch_pages) * batch_latency + n * page_bytes / bandwidth
    prefill C(t, c) = a*t + b*t*(c + t/2)/1000 + fixed, t >= 1  (c + t/2: the new tokens' mean attention span)
    wait(k) = max(0, T(max(k, next)) - e) + max(0, e - T(next))  (``e`` s into the load, ``next`` the end of
              the batch in flight: a load late by ``d`` needs ``d`` more; a page comes with its whole batch)

Invariants: ``plan`` and ``should_terminate`` wait for pages only when that is predicted faster than
recomputing now by more than ``margin_s`` (ties and unknowns recompute); a stalled load's predicted finish
grows with its lateness, so it is always cut eventually; estimators are thread-safe, publish immutable
models, and fall back to fewer coefficients rather than a negative speed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sgl_kvtier.estimation import STORAGE_BATCH_PAGES, DecayingLeastSquares, DeviceModel


@dataclass(frozen=True)
class CostConfig:
    """Knobs of the decision: the storage batch (unit of a cut) and the margin a load must win by."""

    batch_pages: int = STORAGE_BATCH_PAGES  # pages per storage batch (one ack, the unit of a cut)
    margin_s: float = 0.0  # a load must beat recomputing by more than this to be waited for

    def __post_init__(self) -> None:
        if self.batch_pages < 1:
            raise ValueError(f"batch_pages must be >= 1, got {self.batch_pages}")
        if not self.margin_s >= 0:
            raise ValueError(f"margin_s must be >= 0, got {self.margin_s}")


@dataclass(frozen=True)
class PrefillModel:
    """Prefill seconds for ``t`` new tokens over ``c`` cached ones: ``a*t + b*t*(c + t/2)/1000 + fixed``."""

    per_token_s: float  # a
    per_token_kctx_s: float  # b: seconds per new token per 1000 tokens of mean attention span
    fixed_s: float = 0.0

    def time(self, tokens: int, cached: int) -> float:
        """Predicted seconds to prefill ``tokens`` new tokens (at least one) after ``cached`` cached ones."""
        t = max(int(tokens), 1)
        return self.per_token_s * t + self.per_token_kctx_s * t * (cached + t / 2) / 1000 + self.fixed_s

    def batch_time(self, requests: Sequence[tuple[int, int]]) -> float:
        """Predicted seconds of one forward over ``(new tokens, cached tokens)`` per request (as
        ``PrefillEstimator.record_batch`` fits it: the fixed cost once)."""
        reqs = [(int(t), int(c)) for t, c in requests if t > 0]
        return sum(self.time(t, c) - self.fixed_s for t, c in reqs) + self.fixed_s

    @classmethod
    def from_tokens_per_s(cls, tokens_per_s: float) -> PrefillModel:
        """A flat model: ``tokens_per_s`` regardless of context."""
        if not tokens_per_s > 0:
            raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s}")
        return cls(1.0 / tokens_per_s, 0.0, 0.0)


@dataclass(frozen=True)
class RequestShape:
    """One request's prompt as the cost model sees it: page geometry, the L3 hit, and what surrounds it."""

    page_tokens: int
    page_bytes: int
    hit_pages: int  # leading pages of the span that L3 holds
    cached_tokens: int = 0  # prompt tokens before the span (device / host hits): neither loaded nor computed
    tail_tokens: int = 0  # prompt tokens after the hit: computed in any case


@dataclass(frozen=True)
class LoadProgress:
    """Where a load in flight stands: pages landed, seconds since it was issued, pages queued ahead of it."""

    loaded_pages: int = 0  # leading hit pages already landed (acknowledged)
    elapsed_s: float = 0.0  # since the load was issued
    queued_pages: int = 0  # other requests' pages ahead of this load on the (FIFO) IO queue


@dataclass(frozen=True)
class Decision:
    """The outcome of ``plan`` / ``should_terminate``: how many hit pages to load, and the predicted TTFTs."""

    load_pages: int  # leading hit pages to end up with
    recompute_pages: int  # hit pages left to the prefill
    ttft_s: float  # predicted TTFT from now for that choice
    recompute_now_s: float  # predicted TTFT from now when stopping (or not loading) now
    terminate: bool  # stop waiting now (pages still pending, and waiting does not pay)


def wait_time(shape: RequestShape, progress: LoadProgress, device: DeviceModel, k: int,
              cfg: CostConfig = CostConfig()) -> float:
    """Predicted seconds from now until the first ``k`` hit pages have landed (0 for pages already there)."""
    loaded = min(progress.loaded_pages, shape.hit_pages)
    k = min(k, shape.hit_pages)
    if k <= loaded:
        return 0.0
    b = cfg.batch_pages

    def t(n: int) -> float:
        return device.load_time(n, shape.page_bytes, b)

    start = t(progress.queued_pages)
    next_end = min(shape.hit_pages, loaded - loaded % b + b)
    if loaded or progress.elapsed_s > 0:  # in flight: a page of the batch under way comes with all of it
        k = max(k, next_end)
    late = max(0.0, progress.elapsed_s - (start + t(next_end)))
    return max(0.0, start + t(k) - progress.elapsed_s) + late


def ttft(shape: RequestShape, progress: LoadProgress, device: DeviceModel, prefill: PrefillModel, k: int,
         cfg: CostConfig = CostConfig()) -> float:
    """Predicted TTFT from now when the request ends up with the first ``k`` hit pages loaded."""
    k = max(min(k, shape.hit_pages), min(progress.loaded_pages, shape.hit_pages))
    compute = prefill.time((shape.hit_pages - k) * shape.page_tokens + shape.tail_tokens,
                           shape.cached_tokens + k * shape.page_tokens)
    return wait_time(shape, progress, device, k, cfg) + compute


def _candidates(hit: int, loaded: int, batch: int, within_batches: bool) -> list[int]:
    """Where TTFT(k) can be minimal: it is concave in k between batch boundaries, so at their ends (and,
    page by page, one short of the hit: the prefill's one-token floor flattens the last page's saving)."""
    ks = {loaded, hit} | ({hit - 1} if within_batches else set())
    for j in range(loaded // batch, math.ceil(hit / batch)):
        hi = min((j + 1) * batch, hit)
        ks.add(hi)
        if within_batches:
            ks.add(min(j * batch + 1, hit))
    return sorted(k for k in ks if loaded <= k <= hit)


def _choose(shape: RequestShape, progress: LoadProgress, device: DeviceModel, prefill: PrefillModel,
            cfg: CostConfig, within_batches: bool) -> Decision:
    hit = max(0, shape.hit_pages)
    loaded = max(0, min(progress.loaded_pages, hit))
    now = ttft(shape, progress, device, prefill, loaded, cfg)
    best_k, best = loaded, now
    for k in _candidates(hit, loaded, cfg.batch_pages, within_batches):
        cost = ttft(shape, progress, device, prefill, k, cfg)
        if cost < best:  # strict: among equals the fewest pages
            best_k, best = k, cost
    if best_k != loaded and not best + cfg.margin_s < now:
        best_k, best = loaded, now
    return Decision(best_k, hit - best_k, best, now, terminate=best_k == loaded and loaded < hit)


def plan(shape: RequestShape, device: DeviceModel, prefill: PrefillModel, progress: LoadProgress = LoadProgress(),
         cfg: CostConfig = CostConfig()) -> Decision:
    """How many leading hit pages to load (any page count) so that the predicted TTFT is minimal."""
    return _choose(shape, progress, device, prefill, cfg, within_batches=True)


def should_terminate(shape: RequestShape, progress: LoadProgress, device: DeviceModel, prefill: PrefillModel,
                     cfg: CostConfig = CostConfig()) -> Decision:
    """The stop decision for a load in flight: ``terminate`` as soon as waiting for any further batch
    boundary (or the whole hit) is predicted to finish no earlier than computing the remainder now."""
    return _choose(shape, progress, device, prefill, cfg, within_batches=False)


# ---------------------------------------------------------------------------------------------- estimators
class PrefillEstimator:
    """Least-squares fit of ``PrefillModel`` over observed prefill batches (weights halve every
    ``half_life`` batches). Until ``min_samples`` batches were seen, ``model()`` is ``seed`` (may be None)."""

    _SUBSETS = ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,))

    def __init__(self, half_life: float = 64.0, min_samples: int = 4, seed: PrefillModel | None = None):
        self._ls = DecayingLeastSquares(3, half_life, self._SUBSETS)
        self._lock = threading.Lock()
        self.min_samples = max(1, min_samples)
        self.seed = seed
        self._fit: PrefillModel | None = None

    def record_batch(self, requests: Sequence[tuple[int, int]], seconds: float) -> None:
        """One forward: ``(new tokens, cached tokens)`` per request, and its duration."""
        reqs = [(int(t), int(c)) for t, c in requests if t > 0]
        if not reqs or not 0 < seconds < math.inf:
            return
        x = (sum(t for t, _ in reqs) / 1e3, sum(t * (c + t / 2) for t, c in reqs) / 1e6, 1.0)
        with self._lock:
            self._ls.add(x, seconds)
            theta = self._ls.solve()
            if theta is not None:
                self._fit = PrefillModel(theta[0] / 1e3, theta[1] / 1e3, theta[2])

    def record(self, tokens: int, cached: int, seconds: float) -> None:
        """One forward of a single request."""
        self.record_batch([(tokens, cached)], seconds)

    @property
    def samples(self) -> int:
        """How many batches were recorded."""
        return self._ls.count

    def model(self) -> PrefillModel | None:
        """The fit once ``min_samples`` batches were seen, else ``seed``."""
        return self._fit if self._fit is not None and self.samples >= self.min_samples else self.seed

    def snapshot(self) -> dict[str, Any]:
        """The model as JSON-ready figures, with its sample count and source (``fit``, ``seed`` or None)."""
        m = self.model()
        fields = ("per_token_s", "per_token_kctx_s", "fixed_s")
        return {**{f: None if m is None else getattr(m, f) for f in fields}, "samples": self.samples,
                "source": "fit" if m is not None and m is self._fit else "seed" if m is not None else None}


__all__ = ["CostConfig", "DeviceModel", "PrefillModel", "RequestShape", "LoadProgress", "Decision", "wait_time",
           "ttft", "plan", "should_terminate", "PrefillEstimator", "STORAGE_BATCH_PAGES"]
