"""Gates: what the L3 arm must achieve against the baseline arm, at each concurrency, for ``verify`` to pass.

Defaults follow the acceptance gates of published NVMe-oF KV offload measurements: TTFT p50 down at least
25%, request throughput up at least 29%. A gate without a figure on either side (an arm that failed, a level
that served no request) is ``NO_DATA``, which fails the run like ``FAIL``: no pass without a measurement.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Verdict(Enum):
    PASS = "pass"
    FAIL = "fail"
    NO_DATA = "no data"


@dataclass(frozen=True)
class Gates:
    """Minimum relative gains of the L3 arm over the baseline (0.25 = 25%); ``None`` turns a gate off.
    ``max_error_rate``: failed requests allowed in the L3 arm, as a share of its requests."""

    ttft_p50_cut: float | None = 0.25
    ttft_p99_cut: float | None = None
    throughput_gain: float | None = 0.29
    max_error_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ttft_p50_cut", "ttft_p99_cut"):
            v = getattr(self, name)
            if v is not None and not -math.inf < v < 1:
                raise ValueError(f"{name} must be below 1 (a share of the baseline's TTFT), got {v}")
        if not 0 <= self.max_error_rate <= 1:
            raise ValueError(f"max_error_rate must be in [0, 1], got {self.max_error_rate}")


@dataclass(frozen=True)
class GateResult:
    """One gate at one concurrency: the figures it compared, the gain reached and required, the verdict."""

    gate: str
    concurrency: int
    baseline: float | None
    value: float | None
    achieved: float | None
    required: float
    verdict: Verdict

    def as_dict(self) -> dict[str, Any]:
        return {"gate": self.gate, "concurrency": self.concurrency, "baseline": self.baseline, "value": self.value,
                "achieved": self.achieved, "required": self.required, "verdict": self.verdict.value}


def _number(cell: Mapping[str, Any] | None, key: str) -> float | None:
    v = None if cell is None else cell.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and (cell or {}).get("requests") else None


def _cut(base: float | None, value: float | None) -> float | None:
    """1 - value / base: how much lower ``value`` is (a TTFT)."""
    return None if base is None or value is None or base <= 0 else 1.0 - value / base


def _gain(base: float | None, value: float | None) -> float | None:
    """value / base - 1: how much higher ``value`` is (a throughput)."""
    return None if base is None or value is None or base <= 0 else value / base - 1.0


def judge(gate: str, concurrency: int, base: float | None, value: float | None, achieved: float | None,
          required: float) -> GateResult:
    verdict = Verdict.NO_DATA if achieved is None else Verdict.PASS if achieved >= required else Verdict.FAIL
    return GateResult(gate, concurrency, base, value, achieved, required, verdict)


def evaluate(gates: Gates, l3: Mapping[int, Mapping[str, Any]], baseline: Mapping[int, Mapping[str, Any]],
             levels: Sequence[int] = ()) -> list[GateResult]:
    """Every gate at every concurrency of ``levels`` and ``l3`` (summaries by concurrency,
    ``serving.summary.summarize``) against ``baseline``'s summary at the same concurrency; a level ``l3``
    lacks (its arm failed before it) is judged NO_DATA."""
    out: list[GateResult] = []
    for c in sorted({*levels, *l3}):
        cell, base = l3.get(c, {}), baseline.get(c)
        for gate, key, required, measure in (("ttft_p50_cut", "ttft_p50_s", gates.ttft_p50_cut, _cut),
                                             ("ttft_p99_cut", "ttft_p99_s", gates.ttft_p99_cut, _cut),
                                             ("throughput_gain", "req_per_s", gates.throughput_gain, _gain)):
            if required is None:
                continue
            b, v = _number(base, key), _number(cell, key)
            out.append(judge(gate, c, b, v, measure(b, v), required))
        requests = int(cell.get("requests") or 0)
        rate = cell.get("errors", 0) / requests if requests else None
        # an error rate passes at or below the limit: stored as the margin left, required 0
        out.append(judge("error_rate", c, None, rate, None if rate is None else gates.max_error_rate - rate, 0.0))
    return out


def passed(results: list[GateResult]) -> bool:
    """Whether every gate passed (an empty list does not pass: nothing was judged)."""
    return bool(results) and all(r.verdict is Verdict.PASS for r in results)
