"""Stream a hit, or load it whole? The bind-time rule of a streamed L3 tail and the figures it learns on the
running server. Pure Python: no clock, no SGLang; callers pass measurements in.

A hit loaded whole costs its request ``W`` (SGLang's prefetch, from the op's start to its handled result) plus
``X`` (SGLang's host -> device copy when it admits the request; 0 where that copy is asynchronous) before the
suffix's compute ``c`` starts. A streamed hit waits at the gate (``rules.gate``), then its forward runs while the
tail lands, slower by ``k`` seconds per tail byte where the landing takes the forward's cores (about 0 on a GPU).
With ``R`` the hit's predicted read (the store's read model) in read groups of ``shares`` (``rules.read_groups``;
even over ``G`` where not given) and ``S = stall_s(shares, R, c + k * bytes)`` the pipeline's fill and stalls:

    gain  =  W + X  -  S  -  k * bytes
    STREAM  when  gain  >=  MIN_GAIN_SHARE * (W + X + c)    (else WHOLE)

Learned figures (``StreamCosts``, thread-safe): ``W`` and ``X`` as ``a + bytes / bw`` fits weighted halving every
``HALF_LIFE`` samples, from hits loaded whole while no other prefetch ran and from SGLang's own load-backs (until
learned, ``W`` is taken as ``R`` and ``X`` as 0); ``k`` from the last ``K_WINDOW`` forwards that ran with tails and
never waited on one: each one's time minus the prefill model's prediction for its shape, per tail byte (least
squares through 0, at least 0), judged against the model at decision time, not at record time. Until
``MIN_SAMPLES`` were seen, or without a prefill model, ``k`` is unknown and the hit streams (that is how ``k`` is
measured).

The model leaves out what it cannot see (a whole load's time outside W, a streamed hit's gate waits and stalls), so
each hit the rule decided, alone, is also timed end to end (``begin_hit`` / ``finish_hit``): its op's start to the
result of the forward that gave its first token, minus the prefill model's time for that batch, is the path's
*excess* over a device hit, fitted per byte as ``k`` over the last ``HIT_WINDOW`` hits of each path. Once both paths
have ``min_samples``, they decide and the model is only the prior:

    STREAM  when  excess_whole - excess_stream  >=  MIN_GAIN_SHARE * (excess_whole + c)

Each choice feeds only its own figure, so every ``EXPLORE_EVERY``-th decided hit takes the other path (a device
that changed speed is seen). Unknown ``R`` or ``c``: the hit streams (the gate's safe minimum decides when to admit).

Invariants: ``decide`` never raises for finite inputs and answers a reason with every verdict; a sample that is
not finite, or of no bytes, is ignored; at most ``MAX_PENDING`` hits are timed at once (the oldest is forgotten
first: a request aborted before its first token never leaks).
"""

from __future__ import annotations

import enum
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sgl_kvtier.estimation import TransferEstimator
from sgl_kvtier.experiments.streaming.rules.read_groups import check_shares, or_even, stall_s
from sgl_kvtier.telemetry.snapshot import StreamBindSnapshot

MIN_GAIN_SHARE = 0.05  # a stream must be predicted to save this share of the whole-load TTFT
MIN_SAMPLES = 2  # samples of a learned figure before it is used
HALF_LIFE = 16.0  # samples
EXPLORE_EVERY = 16  # every n-th decided hit takes the other path (0: never)
K_WINDOW = 16  # streamed forwards kept for k
HIT_WINDOW = 16  # hits kept per path for the measured comparison
MAX_PENDING = 256  # hits being timed (begun, no first token yet)
Shape = tuple[tuple[int, int], ...]  # a batch: (new tokens, cached tokens) per request
Predict = Callable[[list[tuple[int, int]]], float]  # the prefill model's batch time for a shape


class BindVerdict(enum.Enum):
    """The bind rule's choice for one hit."""

    STREAM = "stream"
    WHOLE = "whole"


@dataclass(frozen=True)
class BindInputs:
    """One hit at bind time."""

    hit_bytes: int
    groups: int  # layer groups per page (G >= 1)
    read_s: float | None  # predicted read of the whole hit (the store's read model; None: not measured)
    suffix_compute_s: float | None  # predicted prefill of the tokens after the hit (None: no prefill model)
    whole_wait_s: float | None = None  # learned W for this hit (None: not learned yet, R stands in)
    interference_s_per_byte: float | None = None  # learned k (None: not learned yet)
    load_back_s: float | None = None  # learned X for this hit (None: not learned yet, taken as 0)
    measured_whole_s: float | None = None  # a whole load's measured excess over compute (None: too few samples)
    measured_stream_s: float | None = None  # a streamed hit's measured excess (None: too few)
    shares: tuple[float, ...] = ()  # each read group's share of the hit ((): even over ``groups``)

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        if self.hit_bytes < 0:
            raise ValueError(f"hit_bytes must be >= 0, got {self.hit_bytes}")
        check_shares(self.shares, self.groups)


@dataclass(frozen=True)
class BindDecision:
    """A verdict, its reason and the predicted gain behind it."""

    verdict: BindVerdict
    reason: str  # a short label (counted by the plugin)
    gain_s: float | None = None  # the predicted gain, where computed


def _known(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x >= 0


def decide(inputs: BindInputs, min_gain_share: float = MIN_GAIN_SHARE) -> BindDecision:
    """The rule of the module docstring for one hit."""
    read, c = inputs.read_s, inputs.suffix_compute_s
    whole_x, stream_x = inputs.measured_whole_s, inputs.measured_stream_s
    if _known(whole_x) and _known(stream_x):
        assert whole_x is not None and stream_x is not None
        gain = whole_x - stream_x
        if gain >= min_gain_share * (whole_x + (c if c is not None and _known(c) else 0.0)):
            return BindDecision(BindVerdict.STREAM, "measured faster: streamed", gain)
        return BindDecision(BindVerdict.WHOLE, "measured no faster: loaded whole", gain)
    if not _known(read) or not _known(c):
        return BindDecision(BindVerdict.STREAM, "unmeasured: streamed")
    assert read is not None and c is not None
    k = inputs.interference_s_per_byte
    if not _known(k):
        return BindDecision(BindVerdict.STREAM, "calibrating: streamed")
    assert k is not None
    whole = inputs.whole_wait_s if _known(inputs.whole_wait_s) else read
    assert whole is not None
    if _known(inputs.load_back_s):
        assert inputs.load_back_s is not None
        whole += inputs.load_back_s
    interference = k * inputs.hit_bytes
    gain = whole - stall_s(or_even(inputs.shares, inputs.groups), read, c + interference) - interference
    if gain >= min_gain_share * (whole + c):
        return BindDecision(BindVerdict.STREAM, "predicted faster: streamed", gain)
    return BindDecision(BindVerdict.WHOLE, "predicted no faster: loaded whole", gain)


class StreamCosts:
    """The learned figures of one backend (W, k, X) and its exploration counter (module docstring)."""

    def __init__(self, explore_every: int = EXPLORE_EVERY, min_samples: int = MIN_SAMPLES):
        self._lock = threading.Lock()  # guards k's samples and the counter (the estimators have their own)
        self._whole = TransferEstimator(HALF_LIFE)  # W: seconds ~= fixed + bytes / rate, as the store's reads
        self._forwards: deque[tuple[int, Shape, float]] = deque(maxlen=K_WINDOW)  # k's raw samples
        self._load_back = TransferEstimator(HALF_LIFE)  # X: SGLang's own host -> device copies
        self._pending: OrderedDict[str, tuple[BindVerdict, float, int]] = OrderedDict()  # rid -> path, start, bytes
        self._hits: dict[BindVerdict, deque[tuple[int, Shape, float]]] = {
            path: deque(maxlen=HIT_WINDOW) for path in BindVerdict}  # the measured comparison's raw samples
        self._explore_every = explore_every
        self._min = max(1, min_samples)
        self._decided = 0

    def record_whole(self, nbytes: int, seconds: float) -> None:
        """A hit of ``nbytes`` loaded whole, alone, in ``seconds`` (op start to its handled result)."""
        self._whole.record(nbytes, seconds)  # ignores an empty or untimed one

    def record_load_back(self, nbytes: int, seconds: float) -> None:
        """SGLang's own load-back of ``nbytes`` (host -> device, before a forward) took ``seconds``."""
        self._load_back.record(nbytes, seconds)

    def load_back_s(self, nbytes: int) -> float | None:
        """Learned X for ``nbytes`` (None: too few samples)."""
        return self._predicted(self._load_back, nbytes)

    def record_stream_forward(self, nbytes: int, shape: Sequence[tuple[int, int]], seconds: float) -> None:
        """A forward of batch ``shape`` with ``nbytes`` of streamed tails took ``seconds`` (never waited on one)."""
        if nbytes > 0 and shape and math.isfinite(seconds) and seconds >= 0:
            with self._lock:
                self._forwards.append((nbytes, tuple((int(e), int(p)) for e, p in shape), float(seconds)))

    def whole_wait_s(self, nbytes: int) -> float | None:
        """Learned W for ``nbytes`` (None: too few samples)."""
        return self._predicted(self._whole, nbytes)

    def _predicted(self, fit: TransferEstimator, nbytes: int) -> float | None:
        """``fit``'s seconds for ``nbytes`` once it has ``min_samples``; None before."""
        model = fit.model() if fit.samples >= self._min else None
        return None if model is None else model.batch_latency_s + nbytes / model.bandwidth_Bps

    def interference_s_per_byte(self, predict: Predict | None) -> float | None:
        """k against ``predict`` (the prefill model's batch time now); None: too few samples or no model."""
        with self._lock:
            samples = list(self._forwards)
        return self._excess_per_byte(samples, predict)

    def _excess_per_byte(self, samples: list[tuple[int, Shape, float]], predict: Predict | None) -> float | None:
        """Seconds over ``predict`` per byte, least squares through 0, at least 0; None: too few or no model."""
        if predict is None or len(samples) < self._min:
            return None
        num = den = 0.0
        for nbytes, shape, seconds in samples:
            excess, mb = seconds - predict(list(shape)), nbytes / 1e6
            if math.isfinite(excess):
                num, den = num + mb * excess, den + mb * mb
        return None if den <= 0 else max(0.0, num / den) / 1e6  # no fit >= 0: no slower than predicted

    # -------------------------------------------------------------------- the measured comparison
    def begin_hit(self, rid: str, path: BindVerdict, start_s: float, nbytes: int) -> None:
        """Request ``rid``'s hit of ``nbytes`` takes ``path``; its op started at ``start_s`` (module docstring)."""
        if nbytes > 0 and math.isfinite(start_s):
            with self._lock:
                self._pending.pop(rid, None)
                self._pending[rid] = (path, float(start_s), int(nbytes))
                while len(self._pending) > MAX_PENDING:
                    self._pending.popitem(last=False)

    def timing(self, rid: str) -> BindVerdict | None:
        """The path of ``rid``'s hit while it is being timed (None: it is not)."""
        with self._lock:
            entry = self._pending.get(rid)
        return None if entry is None else entry[0]

    def finish_hit(self, rid: str, end_s: float, shape: Sequence[tuple[int, int]] | None) -> BindVerdict | None:
        """Request ``rid``'s first token came from a forward of batch ``shape`` whose result was handled at
        ``end_s``: the sample of its path, returned (None: it was not timed, or ``shape`` is None: not a
        valid sample, dropped)."""
        with self._lock:
            entry = self._pending.pop(rid, None)
            if entry is None or not shape:
                return None
            path, start, nbytes = entry
            seconds = end_s - start
            if not (math.isfinite(seconds) and seconds >= 0):
                return None
            self._hits[path].append((nbytes, tuple((int(e), int(p)) for e, p in shape), seconds))
            return path

    def measured_s(self, path: BindVerdict, nbytes: int, predict: Predict | None) -> float | None:
        """``path``'s measured excess over compute for a hit of ``nbytes`` (None: too few samples, no model)."""
        with self._lock:
            samples = list(self._hits[path])
        per_byte = self._excess_per_byte(samples, predict)
        return None if per_byte is None else per_byte * nbytes

    def decide(self, hit_bytes: int, groups: int, read_s: float | None, suffix_compute_s: float | None,
               predict: Predict | None = None, shares: tuple[float, ...] = ()) -> BindDecision:
        """``decide`` with the learned figures (k against ``predict``); every ``explore_every``-th decided hit
        takes the other path."""
        decision = decide(BindInputs(hit_bytes, groups, read_s, suffix_compute_s, self.whole_wait_s(hit_bytes),
                                     self.interference_s_per_byte(predict), self.load_back_s(hit_bytes),
                                     self.measured_s(BindVerdict.WHOLE, hit_bytes, predict),
                                     self.measured_s(BindVerdict.STREAM, hit_bytes, predict), shares))
        if decision.gain_s is None or self._explore_every <= 0:
            return decision
        with self._lock:
            self._decided += 1
            explore = self._decided % self._explore_every == 0
        if not explore:
            return decision
        other = BindVerdict.WHOLE if decision.verdict is BindVerdict.STREAM else BindVerdict.STREAM
        return BindDecision(other, f"re-measuring: {'streamed' if other is BindVerdict.STREAM else 'loaded whole'}",
                            decision.gain_s)

    def snapshot(self, predict: Predict | None = None) -> StreamBindSnapshot:
        """The learned figures (None: not learned; k against ``predict``) and their sample counts."""
        with self._lock:
            k_samples = len(self._forwards)
            hits = {path: len(samples) for path, samples in self._hits.items()}
        k = self.interference_s_per_byte(predict)
        whole_x, stream_x = (self.measured_s(path, 1_000_000, predict)
                             for path in (BindVerdict.WHOLE, BindVerdict.STREAM))
        (whole_fixed, whole_mb), (copy_fixed, copy_mb) = _fixed_per_mb(self._whole), _fixed_per_mb(self._load_back)
        return StreamBindSnapshot(
            whole_wait_fixed_s=whole_fixed, whole_wait_s_per_mb=whole_mb, whole_samples=self._whole.samples,
            interference_s_per_mb=None if k is None else k * 1e6, interference_samples=k_samples,
            load_back_fixed_s=copy_fixed, load_back_s_per_mb=copy_mb, load_back_samples=self._load_back.samples,
            measured_whole_s_per_mb=whole_x, measured_whole_hits=hits[BindVerdict.WHOLE],
            measured_stream_s_per_mb=stream_x, measured_stream_hits=hits[BindVerdict.STREAM])


def _fixed_per_mb(fit: TransferEstimator) -> tuple[float | None, float | None]:
    """(fixed seconds, seconds per MB) of ``fit``'s model; (None, None) before it has one."""
    model = fit.model()
    return (None, None) if model is None else (model.batch_latency_s, 1e6 / model.bandwidth_Bps)


__all__ = ["BindDecision", "BindInputs", "BindVerdict", "EXPLORE_EVERY", "HIT_WINDOW", "MAX_PENDING", "MIN_GAIN_SHARE",
           "StreamCosts", "decide"]
