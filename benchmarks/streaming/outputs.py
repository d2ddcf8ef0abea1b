"""Outputs identical with streaming off and on: the same measured L3 request, greedy, on two servers.

Every server serves the same rounds (same prompts, same request ids, ``temperature`` 0, ``ignore_eos``), so
request ``rid`` of round ``i`` must produce the same output on the ``off`` and the ``on`` server of a device.
Outputs are compared as token ids when both records have them, else as text. A request that failed on
either side is ``missing``, not a difference. At C > 1 the batches two servers form can differ, and with
them the floating-point sums of a CPU forward: a difference there is not necessarily streaming's.

The control: the write round, where each server computes every document from scratch (no L3 read,
streaming plays no part). Each server stores the KV it computed itself, so a document whose write-round
output already differs between the two servers (their processes' own bf16 arithmetic: 2 of 8
documents in one measured run) has different KV in each server's L3, and a measured difference on it is not
streaming's. ``attributable`` lists the measured differences at C = 1 (alone: the same batches on both
servers) on documents whose control was identical.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.streaming.rounds import MEASURED

SHOWN = 10  # differing request ids kept per level


def _output(rec: Mapping[str, Any]) -> Any:
    if "error" in rec:
        return None
    ids = rec.get("output_ids")
    return tuple(ids) if ids is not None else rec.get("text")


CONTROL = "write"  # the round kind compared as the control (module docstring)


def outputs(server: Mapping[str, Any], kind: str = MEASURED) -> dict[tuple[int, str], tuple[int, Any]]:
    """(round index, rid) -> (concurrency, output) of a server's requests of rounds ``kind`` (None: failed)."""
    out: dict[tuple[int, str], tuple[int, Any]] = {}
    for rnd in server.get("rounds", []):
        if rnd.get("kind") != kind:
            continue
        for rec in rnd["requests"]:
            out[(rnd["index"], rec["rid"])] = (rnd["concurrency"], _output(rec))
    return out


def compare(off: Mapping[str, Any], on: Mapping[str, Any], kind: str = MEASURED) -> dict[str, dict[str, Any]]:
    """Per concurrency level (as a string key): requests of rounds ``kind`` compared, identical, missing, and
    the first differing request ids."""
    a, b = outputs(off, kind), outputs(on, kind)
    levels: dict[str, dict[str, Any]] = {}
    for key in sorted(a.keys() | b.keys()):
        c = (a.get(key) or b[key])[0]
        cell = levels.setdefault(str(c), {"compared": 0, "identical": 0, "missing": 0, "different": []})
        x, y = (a.get(key) or (c, None))[1], (b.get(key) or (c, None))[1]
        if x is None or y is None:
            cell["missing"] += 1
            continue
        cell["compared"] += 1
        if x == y:
            cell["identical"] += 1
        elif len(cell["different"]) < SHOWN:
            cell["different"].append(key[1])
    return levels


def all_identical(levels: Mapping[str, Mapping[str, Any]]) -> bool | None:
    """True when every compared output was identical and nothing was missing; None when nothing compared."""
    if not levels or not any(v["compared"] for v in levels.values()):
        return None
    return all(v["identical"] == v["compared"] and not v["missing"] for v in levels.values())


def document(rid: str) -> str:
    """The document a request id asks about (``d6-q3`` -> ``d6``)."""
    return rid.split("-", 1)[0]


def attributable(measured: Mapping[str, Mapping[str, Any]], control: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The measured differences at C = 1 on documents whose control outputs were identical on both servers."""
    unequal = {document(rid) for cell in control.values() for rid in cell["different"]}
    return [rid for rid in measured.get("1", {}).get("different", []) if document(rid) not in unequal]
