"""The streaming figures read off a running server: ``/metrics`` before and after each phase, and its log.

From ``/metrics`` (summed over labels: ranks, pools): every ``kvtier_stream*`` sample, whatever the stream
plugin names them (streamed pages, gate waits, failed groups, retracted requests: gauges of running totals,
as the backend's other ``kvtier_`` gauges), the store's part counters (``kvtier_store_parts_read`` /
``_parts_failed``: parts read group-major and verified / failed), the adapter's caught exceptions, and
SGLang's own ``sglang:num_retracted_requests_total``. A phase's figure is after - before; a name absent on
both sides is absent (never a made-up 0). A figure by ``reason`` (``kvtier_stream_not_streamed``,
``_dropped``) is also kept per reason (``stream_not_streamed[busy: loaded whole]``). The bind rule's
learned figures (``BIND``) are levels, not totals: ``bind`` reads them as they are. From the log:
tracebacks through sgl_kvtier (a bug), lines naming a retract, and lines of the stream plugin.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sgl_kvtier.telemetry.prometheus import STREAM_BIND

STREAM_PREFIX = "kvtier_stream"
# The bind rule's learned figures, as the exporter names them (``kvtier_stream_bind_calls`` is not one:
# a hook counter, a running total).
BIND = frozenset(f"kvtier_{gauge}" for gauge, _help in STREAM_BIND.values())
NAMED = {
    "parts_read": "kvtier_store_parts_read",
    "parts_failed": "kvtier_store_parts_failed",
    "boundary_errors": "kvtier_boundary_errors",
    "retracted_requests": "sglang:num_retracted_requests_total",
}
Sample = tuple[str, dict[str, str], float]


def read(samples: Iterable[Sample]) -> dict[str, float]:
    """The streaming figures of one ``/metrics`` scrape (``client.scrape``'s samples)."""
    by_name = {v: k for k, v in NAMED.items()}
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name in BIND:
            continue  # levels, not running totals: ``bind`` reads them
        if name.startswith(STREAM_PREFIX):
            key = name.removeprefix("kvtier_")
            if "reason" in labels:  # by reason: a figure each (why hits were not streamed, tails dropped)
                by_reason = f"{key}[{labels['reason']}]"
                out[by_reason] = out.get(by_reason, 0.0) + value
        elif name in by_name:
            key = by_name[name]
        else:
            continue
        out[key] = out.get(key, 0.0) + value
    return out


def bind(samples: Iterable[Sample]) -> dict[str, float]:
    """The bind rule's learned figures now (``kvtier_stream_bind_*`` gauges, ``bind_`` + the rest of the name;
    rank 0's, where there are several ranks): levels, reported as they are at the end of a phase."""
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name in BIND and labels.get("tp_rank", "0") == "0":
            out[name.removeprefix("kvtier_stream_")] = value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """after - before for every figure either side has."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(after.keys() | before.keys())}


def total(phases: Iterable[dict[str, Any]], record: str = "stream_counters") -> dict[str, float]:
    """The sum of the phases' ``record`` deltas (``stream_counters``, or ``thread_cpu_s``: CPU seconds by
    thread group, ``serving.probes.thread_cpu``)."""
    out: dict[str, float] = {}
    for phase in phases:
        for k, v in phase.get(record, {}).items():
            out[k] = out.get(k, 0.0) + v
    return out


def log_counts(text: str) -> dict[str, int]:
    """Tracebacks through sgl_kvtier, lines naming a retract, and the stream plugin's lines in a server log."""
    from sgl_kvtier.serving.server import tracebacks_through

    lines = text.splitlines()
    return {
        "sgl_kvtier_tracebacks": len(tracebacks_through(text)),
        "retract_lines": sum("retract" in line.lower() for line in lines),
        "stream_lines": sum("sgl_kvtier" in line and "stream" in line.lower() for line in lines),
    }
