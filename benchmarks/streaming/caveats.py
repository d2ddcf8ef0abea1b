"""bench_streaming's warnings under the targets: the cells whose on/off is no streaming figure. The ``on``
server recomputed what ``off`` loaded (``fallbacks``), loaded hits whole because its withheld cap was full
(``capped``), or streamed few of its hits at all (``few_streamed``: the bind rule or the busy rule loaded the
rest whole, so its ratio compares mostly the same path on both servers: the noise floor's reading)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.streaming.cells import Cell, cell, levels, server_keys

STREAMED = "stream_tails"  # tails registered (``stream_admit``): the hits that streamed
NOT_STREAMED = "stream_not_streamed["  # its reasons, the stream plugin's label (``stream_bind``)


def unfulfilled(c: Cell) -> float:
    """L3 hits found but not served (SGLang's ``unfulfilled_*`` reasons, summed): recomputed instead."""
    return float(sum(v for k, v in c.get("metrics", {}).items() if k.startswith("unfulfilled_")))


def fallbacks(run: Mapping[str, Any]) -> list[str]:
    """(device, C) cells whose ``on`` server served fewer L3 tokens than the ``off`` one: there the on path
    recomputed what off loaded, so its TTFT is not a streaming figure."""
    out = []
    for device in run["device_order"]:
        for c in levels(run, device):
            off, on = cell(run, device, "off", "l3", c), cell(run, device, "on", "l3", c)
            if off and on and on["cached_tokens"]["storage"] < off["cached_tokens"]["storage"]:
                out.append(f"{device} C={c}: on served {on['cached_tokens']['storage']} L3 tokens, off "
                           f"{off['cached_tokens']['storage']} ({unfulfilled(on):.0f} unfulfilled)")
    return out


CAPPED = "stream_not_streamed[withheld cap: loaded whole]"  # the stream plugin's reason, stream_bind


def capped(run: Mapping[str, Any]) -> list[str]:
    """(device, server, C) cells where streaming servers loaded hits whole because the withheld cap (a share of the
    host pool) was full: sized for fewer concurrent requests than the hit needs, they ran the off path."""
    out = []
    for device in run["device_order"]:
        for key in server_keys(run, device):
            for c in levels(run, device):
                found = cell(run, device, key, "l3", c)
                n = (found or {}).get("stream", {}).get(CAPPED, 0)
                if found and n:
                    out.append(f"{device} {key} C={c}: {n:g} of {found['requests']} requests")
    return out


def few_streamed(run: Mapping[str, Any]) -> list[str]:
    """(device, server, C) cells of streaming servers that streamed under half of their measured requests' hits,
    with the reasons the rest loaded whole (all but ``no tail``: a hit landed whole before any was left)."""
    out = []
    for device in run["device_order"]:
        for key in server_keys(run, device):
            for c in levels(run, device):
                found = cell(run, device, key, "l3", c)
                stream = (found or {}).get("stream", {})
                if not found or STREAMED not in stream or stream[STREAMED] * 2 >= found["requests"]:
                    continue
                why = {k[len(NOT_STREAMED):-1]: v for k, v in stream.items()
                       if k.startswith(NOT_STREAMED) and v and k != f"{NOT_STREAMED}no tail]"}
                reasons = ", ".join(f"{k} {v:g}" for k, v in sorted(why.items(), key=lambda kv: -kv[1]))
                out.append(f"{device} {key} C={c}: {stream[STREAMED]:g} of {found['requests']}"
                           + (f" ({reasons})" if reasons else ""))
    return out
