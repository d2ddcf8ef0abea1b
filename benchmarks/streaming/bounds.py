"""How low streaming's on/off can go in a run, by its parts: the ceiling under which a target is judged.

With streaming off, an L3 hit's TTFT is its whole-load wait before admission (the ``prefetch_wait_s`` phase)
plus everything a device hit costs too. A streamed hit can remove at most that wait, and its landing (reads,
checksums, host -> device copies) runs beside its forward: on an engine whose forward takes every core
(a CPU engine) the forward runs longer by the landing's interference, ``k`` x the tail's bytes, ``k`` as the
on server's bind rule learned it (``experiments.streaming.rules.bind``).

  * ``free``: on/off if a streamed hit waited for nothing and its landing cost the forward nothing,
    ``(off TTFT - off wait) / off TTFT``: no streaming engine can read lower on that run's machine;
  * ``landing``: the same with the landing's learned interference for a whole hit's bytes added,
    ``(off TTFT - off wait + k x hit MB) / off TTFT`` (the tail is the hit less its head: an upper bound
    on the cost, so a lower bound on on/off only while the head is small).

Both are p50 figures of the off cell (the same requests on the same server): a reading, not a model of the
on server; at C = 1 only (with others in flight, the wait holds their loads too). Reported under the
targets, never asserted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Ceiling:
    off_ttft_s: float
    off_wait_s: float
    free: float  # on/off with no wait and a free landing
    landing: float | None  # with the learned interference for a whole hit; None where k was not learned
    landing_s: float | None  # that interference, seconds per hit


def ceiling(off: Mapping[str, Any], on: Mapping[str, Any] | None, hit_mb: float | None) -> Ceiling | None:
    """The ceiling of one (device, C) from its off and on cells and a hit's MB (None: unknown, no landing
    figure); None without the off server's phases."""
    phases = off.get("phases_p50_s") or {}
    ttft, wait = off.get("ttft_p50_s") or 0.0, phases.get("prefetch_wait_s")
    if wait is None or ttft <= 0:
        return None
    k = ((on or {}).get("bind") or {}).get("bind_interference_seconds_per_megabyte")
    landing_s = None if k is None or hit_mb is None else k * hit_mb
    free = (ttft - wait) / ttft
    return Ceiling(ttft, wait, free, None if landing_s is None else free + landing_s / ttft, landing_s)


def ceiling_line(device: str, c: int, found: Ceiling) -> str:
    text = (f"{device} C={c}: on/off can read no lower than {found.free:.2f} (off's L3 wait p50 "
            f"{found.off_wait_s:.3f} s of its TTFT p50 {found.off_ttft_s:.2f} s, all of it removed, the landing free)")
    if found.landing is not None and found.landing_s is not None:
        text += (f"; {found.landing:.2f} with the landing's learned interference ({found.landing_s:.3f} s per hit "
                 "on the forward)")
    return text
