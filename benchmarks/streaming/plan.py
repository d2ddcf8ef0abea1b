"""The servers of one bench_streaming run, in the order they run, and the break-even device.

A run crosses device settings with the two values of the L3 config key ``streaming`` (``off``: a hit loaded
whole before its request is admitted; ``on``: its tail streams in layer groups into the
request's own prefill). Each (device, streaming) pair is one real server with a fresh L3 directory. Devices
(``--devices``):

- ``fast``: the L3 directory's own device, unthrottled;
- ``slow:R[:W]``: reads capped at R MB/s, writes at W (bench_policy's ``DeviceSetting``, sgl-kvtier's
  ``throttle`` table);
- ``breakeven``: throttled so that loading one document prefix takes about as long as computing the
  question suffix: R = prefix KV bytes / suffix compute seconds (``breakeven_mbps``). The compute seconds are
  the device-hit TTFT p50 at the lowest concurrency measured by this run's reference server
  (``suffix_compute_s``), unless ``--breakeven-mbps`` gives R.

Ordering rules (``plan_servers``):
- servers of ``breakeven`` run after every other device's: their rate is known only once the reference
  server has measured the device hit;
- the reference server (L3 rounds plus the device-hit and recompute rounds) is the first server of the run;
  it must not be a ``breakeven`` one whose rate is still unknown (that would be circular);
- within a device, ``off`` runs before ``on`` (the whole-load path first, as a baseline for the same device);
- with ``twin`` (``--twin [MODE]``), each device also gets a second server of that mode after its others
  (key ``off-twin`` or ``on-twin``), interleaved with them. With the same settings, ``off-twin / off``
  measures the run's noise floor, what an on/off ratio of a server on the same path would read by chance;
  with ``--twin-env`` the twin alone runs with more environment, so ``twin / its mode`` measures that
  setting in the same turns (e.g. ``--twin on --twin-env GOMP_SPINCOUNT=1000``).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.serving.policies import DeviceSetting, parse_device
from sgl_kvtier.config import Streaming

BREAKEVEN = "breakeven"
MODES = (Streaming.OFF, Streaming.ON)
TWIN_KEYS = {m: f"{m.value}-twin" for m in MODES}  # a twin server's key (``--twin MODE``), by its mode
TWIN_KEY, ON_TWIN = TWIN_KEYS[Streaming.OFF], TWIN_KEYS[Streaming.ON]
# results.json's records of the paired comparisons, by (baseline server's key, compared server's key): the
# table's column compares each server with ``off``; ``paired_twin`` compares the twin with its own mode's
# server (one twin per device, so one record name serves both modes)
PAIRED_RECORDS = {
    (Streaming.OFF.value, Streaming.ON.value): "paired",
    (Streaming.OFF.value, TWIN_KEY): "paired_twin",
    (Streaming.ON.value, ON_TWIN): "paired_twin",
    (Streaming.OFF.value, ON_TWIN): "paired_on_twin",
}


def twin_of(key: str) -> str | None:
    """The key of the server a twin key (``off-twin``, ``on-twin``) repeats; None for any other key."""
    return next((m.value for m, k in TWIN_KEYS.items() if k == key), None)


@dataclass(frozen=True)
class ServerRun:
    """One server of the run: its device setting (the ``--devices`` spelling), its ``streaming`` value, and
    whether it also serves the reference rounds (device hit, recompute)."""

    device: str
    streaming: Streaming
    references: bool = False
    twin: bool = False

    @property
    def key(self) -> str:
        """Its key under ``results.json``'s ``servers[device]``: the mode, or the mode's twin key."""
        return TWIN_KEYS[self.streaming] if self.twin else self.streaming.value

    @property
    def tag(self) -> str:
        return f"{self.device.replace(':', '-')}-{self.key}"


def check_device(spec: str) -> str:
    """``spec`` if it names a device setting (``fast``, ``breakeven``, ``slow:R[:W]``); ValueError otherwise."""
    if spec != BREAKEVEN:
        parse_device(spec, 0.0)
    return spec


def parse_modes(values: Iterable[str]) -> list[Streaming]:
    """``off`` / ``on`` values (``StoreConfig.streaming``'s), in MODES order, duplicates dropped."""
    wanted = set()
    for v in values:
        try:
            wanted.add(Streaming(v))
        except ValueError:
            raise ValueError(f"streaming mode {v!r}: expected one of {[m.value for m in MODES]}") from None
    return [m for m in MODES if m in wanted]


def plan_servers(devices: Sequence[str], modes: Sequence[Streaming], references: bool,
                 breakeven_known: bool, twin: Streaming | None = None) -> list[ServerRun]:
    """Every (device, mode) server in run order (module docstring); the first carries the references."""
    if len(set(devices)) != len(devices):
        raise ValueError(f"a device setting is listed twice: {list(devices)}")
    if not devices or not modes:
        raise ValueError("at least one device setting and one streaming mode are needed")
    if twin is not None and twin not in modes:
        raise ValueError(f"--twin {twin.value} is a second {twin.value} server: it needs the {twin.value} mode")
    for d in devices:
        check_device(d)
    ordered = [d for d in devices if d != BREAKEVEN] + [d for d in devices if d == BREAKEVEN]
    runs = [r for d in ordered
            for r in [*(ServerRun(d, m) for m in modes), *([ServerRun(d, twin, twin=True)] if twin else [])]]
    if BREAKEVEN in devices and not breakeven_known and (not references or runs[0].device == BREAKEVEN):
        raise ValueError("the breakeven device needs the suffix compute time: keep the references (device hit) "
                         "on a device other than breakeven, or give --breakeven-mbps")
    if references:
        runs[0] = dataclasses.replace(runs[0], references=True)
    return runs


def breakeven_mbps(prefix_bytes: int, compute_s: float) -> float:
    """The read rate (MB/s, 1 MB = 1e6 bytes) at which ``prefix_bytes`` load in ``compute_s``."""
    if prefix_bytes <= 0 or not compute_s > 0:
        raise ValueError(f"break-even needs positive bytes and seconds, got {prefix_bytes} B in {compute_s} s")
    return prefix_bytes / compute_s / 1e6


def prefix_bytes(doc_tokens: int, page_size: int, kv_bytes_per_token: int) -> int:
    """KV bytes of the whole pages of one document prefix: what an L3 hit of it loads."""
    return doc_tokens // page_size * page_size * kv_bytes_per_token


# Beside its KV pools and weights, a CPU server's three processes (HTTP, scheduler, detokenizer: torch loaded in
# each) hold ~2.1 GB (measured: two kvheavy servers with 3.7 GB of pools each take 12.1 GB).
SERVER_OVERHEAD_BYTES = 2_100_000_000
# SGLang refuses a host pool larger than the memory available less 10 GiB (HICACHE_HOST_MEMORY_RESERVE_BYTES,
# sglang/srt/mem_cache/pool_host/base.py): the last server to start must find its pool and the reserve free.
SGLANG_HOST_RESERVE_BYTES = 10 * 1024**3


def memory_short(servers: int, pool_bytes: int, weights_bytes: int, available_bytes: int | None) -> str | None:
    """Why ``servers`` servers up at once would not start (each its KV pools held in host memory, its weights and
    ``SERVER_OVERHEAD_BYTES``; SGLang's host reserve left over for the last one), against the memory available
    now; None where they fit, or where availability is unknown."""
    need = servers * (pool_bytes + weights_bytes + SERVER_OVERHEAD_BYTES) + SGLANG_HOST_RESERVE_BYTES
    if available_bytes is None or need <= available_bytes:
        return None
    return (f"{servers} servers up at once need ~{need / 1e9:.1f} GB (each: KV pools {pool_bytes / 1e9:.1f} GB, "
            f"weights {weights_bytes / 1e9:.1f} GB, ~{SERVER_OVERHEAD_BYTES / 1e9:.1f} GB of processes; then SGLang's "
            f"{SGLANG_HOST_RESERVE_BYTES / 2**30:.0f} GiB host reserve) where {available_bytes / 1e9:.1f} GB are "
            f"available: the last to start would refuse its host pool; lower --host-ratio or --concurrency, or drop "
            f"--twin, or --schedule sequential")


def pure_device_hit(rec: Mapping[str, Any]) -> bool:
    """A request whose cached prefix came from the device pool (L1) alone: no host or L3 load in its TTFT."""
    return "error" not in rec and rec.get("cached_device", 0) > 0 and not rec.get("cached_host", 0) \
        and not rec.get("cached_storage", 0)


def suffix_compute_s(records: Sequence[Mapping[str, Any]]) -> tuple[float, str]:
    """The suffix's compute time: the median TTFT of the pure device hits among ``records`` (the device-hit
    rounds at one concurrency), else of every device-hit record (L2 ones included, which overstates it by
    the host -> device copy). Returns (seconds, which basis). ValueError without a usable record."""
    pure = [r["ttft_s"] for r in records if pure_device_hit(r)]
    if pure:
        return statistics.median(pure), f"median TTFT of {len(pure)} pure device (L1) hits"
    ok = [r["ttft_s"] for r in records if "error" not in r and "ttft_s" in r]
    if not ok:
        raise ValueError("no device-hit request succeeded: the suffix compute time is unknown")
    return statistics.median(ok), f"median TTFT of {len(ok)} device/host (L1/L2) hits"


def breakeven_device(mbps: float, write_mbps: float | None, latency_ms: float) -> DeviceSetting:
    """The throttled setting of the break-even device (named by its rate: ``breakeven-<R>MBps``)."""
    return DeviceSetting(f"{BREAKEVEN}-{mbps:.0f}MBps", round(mbps, 1), write_mbps, latency_ms)


def resolve_device(spec: str, latency_ms: float, breakeven: DeviceSetting | None) -> DeviceSetting:
    """The ``DeviceSetting`` of ``spec``; ``breakeven`` must be known for the break-even device."""
    if spec == BREAKEVEN:
        if breakeven is None:
            raise ValueError("the break-even rate is not known yet")
        return breakeven
    return parse_device(spec, latency_ms)


def server_extra(device: DeviceSetting, user_extra: Mapping[str, Any], mode: Streaming) -> dict[str, Any]:
    """The sgl-kvtier extra config keys of one server: the device's throttle, the caller's keys, then
    ``streaming`` (last, so a ``--kvtier-extra`` can never make an ``off`` server stream or the reverse)."""
    return {**device.kvtier_extra(), **user_extra, "streaming": mode.value}
