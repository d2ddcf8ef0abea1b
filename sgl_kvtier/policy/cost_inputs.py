"""The load-or-recompute policy of one backend: its switch, its measured inputs, and the hit it reports.

Switch: ``KVTIER_PREFETCH_POLICY=cost`` in the server's environment (an environment variable because
SGLang's ``load_plugins()`` decides what to hook before our backend parses its config); anything but
``cost`` is off, an unknown value warned once. Inputs: ``ReadPath`` (page geometry and the store's fitted
read model) and ``PrefillSampler`` (fed by ``experiments.cost_policy.plugin`` from SGLang's per-batch
timings after ``WARMUP_BATCHES``; until fitted, ``KVTIER_PREFILL_TOKENS_PER_S`` or nothing, and the policy
defers to SGLang's own). Invariants: imports no SGLang; ``shorten_hit`` never raises (on any problem: the
unshortened hit, the error counted); with the switch off, nothing here changes a hit.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sgl_kvtier.policy.cost_model import (
    DeviceModel,
    LoadProgress,
    PrefillEstimator,
    PrefillModel,
    RequestShape,
    plan,
    ttft,
)
from sgl_kvtier.telemetry.counters import ErrorBoundary
from sgl_kvtier.telemetry.snapshot import PrefillSnapshot, PrefillSource

log = logging.getLogger(__name__)

ENV_POLICY = "KVTIER_PREFETCH_POLICY"
ENV_PREFILL_TOKENS_PER_S = "KVTIER_PREFILL_TOKENS_PER_S"
WARMUP_BATCHES = 2
LOG_INTERVAL_S = 60.0


class PolicyMode(enum.Enum):
    """The prefetch policy selected by ``KVTIER_PREFETCH_POLICY``."""

    OFF = "off"  # SGLang's own stop policy, hits reported as stored
    COST = "cost"  # the cost model's stop decision and hit length

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> PolicyMode:
        """The mode the environment asks for; an unknown value is OFF, with one warning per value."""
        value = (os.environ if environ is None else environ).get(ENV_POLICY, "").strip().lower()
        if value == cls.COST.value:
            return cls.COST
        if value not in ("", cls.OFF.value):
            _warn_not_a_policy(value)
        return cls.OFF


@functools.lru_cache(maxsize=64)
def _warn_not_a_policy(value: str) -> None:
    log.warning("%s=%r is not a policy (use 'cost' or 'off'); the cost policy stays off", ENV_POLICY, value)


def prefill_seed(environ: Mapping[str, str] | None = None) -> PrefillModel | None:
    """The prefill model ``KVTIER_PREFILL_TOKENS_PER_S`` seeds, or None (unset, or not a positive number)."""
    raw = (os.environ if environ is None else environ).get(ENV_PREFILL_TOKENS_PER_S, "").strip()
    if not raw:
        return None
    try:
        return PrefillModel.from_tokens_per_s(float(raw))
    except ValueError:
        log.warning("%s=%r is not a positive number; ignored", ENV_PREFILL_TOKENS_PER_S, raw)
        return None


class PrefillSampler:
    """The prefill speed of one SGLang process, fitted on its extend batches after ``warmup_batches``.

    Thread-safe. ``estimator`` is the fit (its ``seed`` answers until enough batches were measured).
    """

    def __init__(self, seed: PrefillModel | None = None, warmup_batches: int = WARMUP_BATCHES,
                 estimator: PrefillEstimator | None = None):
        self.estimator = PrefillEstimator(seed=seed) if estimator is None else estimator
        self.warmup_batches = warmup_batches
        self._lock = threading.Lock()
        self._batches_seen = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> PrefillSampler:
        """A sampler seeded from ``KVTIER_PREFILL_TOKENS_PER_S``."""
        return cls(seed=prefill_seed(environ))

    def record_batch(self, extend_lens: Sequence[int], prefix_lens: Sequence[int], seconds: float) -> bool:
        """One finished extend batch (new and cached tokens per request); False when skipped (warm-up, malformed)."""
        if len(extend_lens) != len(prefix_lens) or not extend_lens:
            return False
        with self._lock:
            self._batches_seen += 1
            if self._batches_seen <= self.warmup_batches:
                return False
        self.estimator.record_batch(list(zip(extend_lens, prefix_lens)), seconds)
        return True

    def model(self) -> PrefillModel | None:
        """The prefill model in use: the fit once measured, else the seed, else None."""
        return self.estimator.model()

    def snapshot(self) -> PrefillSnapshot:
        """The model in use and the sample count, typed."""
        snap = self.estimator.snapshot()
        source = snap["source"]
        return PrefillSnapshot(snap["per_token_s"], snap["per_token_kctx_s"], snap["fixed_s"], int(snap["samples"]),
                               None if source is None else PrefillSource(source))


@dataclass(frozen=True)
class ReadPath:
    """The KV pool's read path as the policy sees it: page geometry and the measured read model."""

    page_tokens: int
    page_bytes: int
    device: DeviceModel


@dataclass(frozen=True)
class CostInputs:
    """Both measured inputs of a decision; only exists once both are known."""

    read: ReadPath
    prefill: PrefillModel


class CostPolicy:
    """The load-or-recompute policy of one backend.

    ``read_path`` answers the KV pool's current ``ReadPath`` (None: no pool, no open store, not measured);
    ``boundary`` counts and logs a failed model evaluation (the hit is then kept).
    """

    def __init__(self, read_path: Callable[[], ReadPath | None], prefill: PrefillSampler | None = None,
                 boundary: ErrorBoundary | None = None,
                 mode: Callable[[], PolicyMode] = PolicyMode.from_environ):
        self.prefill = PrefillSampler.from_environ() if prefill is None else prefill
        self._read_path = read_path
        self._boundary = ErrorBoundary(log) if boundary is None else boundary
        self._mode = mode
        self._lock = threading.Lock()
        self._last_log = -LOG_INTERVAL_S

    def enabled(self) -> bool:
        """The switch, read now (so a test or an operator can flip it)."""
        return self._mode() is PolicyMode.COST

    def read_path(self) -> ReadPath | None:
        """The KV pool's read path now (None: no pool, no open store, not measured)."""
        return self._read_path()

    def inputs(self) -> CostInputs | None:
        """Both inputs, or None while either is unknown."""
        read, prefill = self._read_path(), self.prefill.model()
        return None if read is None or prefill is None else CostInputs(read, prefill)

    def shorten_hit(self, queried_pages: int, hit_pages: int, prefix_pages: int) -> int:
        """The hit worth loading: ``plan`` over the span ``batch_exists`` was asked about (``queried_pages``,
        after ``prefix_pages`` pages the tree already holds). The hit unchanged when the policy is off or an
        input is not measured yet."""
        if hit_pages <= 0 or not self.enabled():
            return hit_pages
        try:
            inputs = self.inputs()
            if inputs is None:
                return hit_pages
            read = inputs.read
            shape = RequestShape(read.page_tokens, read.page_bytes, hit_pages,
                                 cached_tokens=prefix_pages * read.page_tokens,
                                 tail_tokens=max(queried_pages - hit_pages, 0) * read.page_tokens)
            decision = plan(shape, read.device, inputs.prefill)
            if decision.load_pages < hit_pages:
                log.info("kvtier cost policy: reporting %d of %d hit pages (predicted TTFT %.3fs vs %.3fs all "
                         "loaded)", decision.load_pages, hit_pages, decision.ttft_s,
                         ttft(shape, LoadProgress(), read.device, inputs.prefill, shape.hit_pages))
        except Exception as exc:  # never into SGLang's prefetch thread: the stored hit stands
            self._boundary.fail("cost policy", exc, outcome="hit kept")
            return hit_pages
        return decision.load_pages

    def log_due(self, now: float) -> bool:
        """True at most once per ``LOG_INTERVAL_S``: time for an INFO line of the measured inputs."""
        with self._lock:
            if now - self._last_log < LOG_INTERVAL_S:
                return False
            self._last_log = now
            return True


__all__ = ["ENV_POLICY", "ENV_PREFILL_TOKENS_PER_S", "WARMUP_BATCHES", "LOG_INTERVAL_S", "PolicyMode",
           "prefill_seed", "PrefillSampler", "ReadPath", "CostInputs", "CostPolicy"]
