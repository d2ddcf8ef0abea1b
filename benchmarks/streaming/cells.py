"""bench_streaming's cells: where a run's summaries sit, ``run["servers"][device][mode]["levels"][level][str(C)]``
(level ``l3`` / ``device`` / ``recompute``), and which servers a device ran (its modes, then a twin)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.streaming.plan import TWIN_KEYS

Cell = dict[str, Any]


def cell(run: Mapping[str, Any], device: str, mode: str, level: str, c: int) -> Cell | None:
    res = run["servers"].get(device, {}).get(mode, {})
    found: Cell | None = res.get("levels", {}).get(level, {}).get(str(c))
    return found


def levels(run: Mapping[str, Any], device: str, level: str = "l3") -> list[int]:
    cs = {int(c) for res in run["servers"].get(device, {}).values() for c in res.get("levels", {}).get(level, {})}
    return sorted(cs)


def twin_key(run: Mapping[str, Any], device: str) -> str | None:
    """The key of ``device``'s twin server (``off-twin``, ``on-twin``) where one ran, else None."""
    return next((k for k in TWIN_KEYS.values() if k in run["servers"].get(device, {})), None)


def server_keys(run: Mapping[str, Any], device: str) -> list[str]:
    """The servers of ``device`` in table order: the run's modes, then the twin where it ran."""
    twin = twin_key(run, device)
    return [*run["modes"], *([twin] if twin else [])]
