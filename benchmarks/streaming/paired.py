"""Paired on/off comparisons of one device: the same measured request on the ``off`` and the ``on`` server.

With the interleaved schedule (``streaming.servers``) the two servers serve round i minutes or seconds
apart, so the machine's drift between them is small next to the drift across a sequential run. Per
concurrency level (a string key, as the other per-level records):

- ``requests``: how many measured requests succeeded on both servers (same round index, same request id);
- ``median_ratio``: the median over those requests of on TTFT / off TTFT;
- ``round_ratios``: per measured round, the on server's TTFT p50 over the off server's, in round order.

A request that failed on either side is left out; a level with none on both sides is absent.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from benchmarks.streaming.rounds import MEASURED


def _ttfts(server: Mapping[str, Any]) -> dict[tuple[int, str], tuple[int, float]]:
    """(round index, rid) -> (concurrency, TTFT s) of a server's successful measured requests."""
    return {(rnd["index"], rec["rid"]): (rnd["concurrency"], float(rec["ttft_s"]))
            for rnd in server.get("rounds", []) if rnd.get("kind") == MEASURED
            for rec in rnd["requests"] if "error" not in rec and rec.get("ttft_s")}


def compare(off: Mapping[str, Any], on: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per concurrency level: the paired figures of the module docstring."""
    a, b = _ttfts(off), _ttfts(on)
    per_level: dict[int, list[tuple[int, float, float]]] = {}
    for key in sorted(a.keys() & b.keys()):
        c = a[key][0]
        per_level.setdefault(c, []).append((key[0], a[key][1], b[key][1]))
    out: dict[str, dict[str, Any]] = {}
    for c, pairs in sorted(per_level.items()):
        by_round: dict[int, tuple[list[float], list[float]]] = {}
        for i, x, y in pairs:
            offs, ons = by_round.setdefault(i, ([], []))
            offs.append(x)
            ons.append(y)
        out[str(c)] = {"requests": len(pairs),
                       "median_ratio": statistics.median(y / x for _, x, y in pairs),
                       "round_ratios": [statistics.median(ons) / statistics.median(offs)
                                        for _, (offs, ons) in sorted(by_round.items())]}
    return out
