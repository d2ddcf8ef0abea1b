"""Replay a trace through the tiers on a simulated clock: per request, the prompt tokens each tier serves, the
L3 bytes read and written, and the time to first token.

The deployment: ``instances`` SGLang instances behind a router, each with an HBM pool and a host pool
(HiCache, write-through: every page reaches host memory, and every page computed is written to the L3 once);
the L3 one shared pool or one per instance. A request's prompt is served by its longest prefix: the blocks
HBM holds, then those host memory holds, then those the L3 holds; the rest is computed. HBM and host
memory do not depend on the L3, so they are replayed once (``local_pass``) and each L3 size on top of that
(``l3_pass``). Time (``timeline``): an L3 load runs while the request waits (SGLang prefetches before it
schedules); an instance then runs one prefill forward after another, each taking every prompt ready when it
starts, for the host-to-HBM copies plus the prefill model's time of the computed tokens over the cached
ones. Decode steps are not modelled (they share the GPU with prefill in a real server). Routing: ``round_robin``
in turn, or ``cache_aware`` as SGLang's router decides it: to the least loaded instance when the load is out
of balance (by more than ``BALANCE_ABS`` requests and ``BALANCE_REL`` times) or when no instance holds
``CACHE_THRESHOLD`` of the prompt, else to the one holding the longest prefix; an instance's load is the
requests it was sent in the last ``LOAD_WINDOW_S`` (the router counts requests in flight).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from sgl_kvtier.config import EvictionPolicyName
from sgl_kvtier.errors import ConfigError
from sgl_kvtier.estimation import DeviceModel
from sgl_kvtier.plan.tiers import Tier
from sgl_kvtier.plan.trace import Trace
from sgl_kvtier.policy.cost_model import PrefillModel

CACHE_THRESHOLD = 0.3  # SGLang router (cache_aware) defaults
BALANCE_ABS = 64
BALANCE_REL = 1.5
LOAD_WINDOW_S = 10.0
MAX_PREFILL_TOKENS = 16384  # SGLang's --max-prefill-tokens default: new tokens in one prefill forward
PREFETCH_HOST_SHARE = 0.5  # SGLang skips a prefetch while those in flight reserve this share of the host pool


class Routing(Enum):
    CACHE_AWARE = "cache_aware"
    ROUND_ROBIN = "round_robin"


class PoolMode(Enum):
    SHARED = "shared"  # one L3 pool for every instance
    PER_INSTANCE = "per_instance"  # the same bytes split evenly, each instance its own


@dataclass(frozen=True)
class Deployment:
    """Instances, their pools (tokens per instance), the array, and how long prefill takes."""

    instances: int
    hbm_tokens: int
    host_tokens: int
    page_tokens: int
    bytes_per_token: int  # one instance's L3 bytes per token (``Geometry.pool_bytes_per_token``)
    array: DeviceModel  # read path per instance: bandwidth and a fixed cost per storage batch
    prefill: PrefillModel
    h2d_Bps: float = 25e9  # host memory to HBM per instance
    routing: Routing = Routing.CACHE_AWARE
    eviction: EvictionPolicyName = EvictionPolicyName.CHAIN
    prefetch_threshold_tokens: int = 256  # SGLang's prefetch_threshold: shorter L3 spans and hits are computed

    def __post_init__(self) -> None:
        for name in ("instances", "page_tokens", "bytes_per_token"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("hbm_tokens", "host_tokens", "prefetch_threshold_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if not self.array.bandwidth_Bps > 0 or not self.h2d_Bps > 0:
            raise ConfigError("read_gbps" if not self.array.bandwidth_Bps > 0 else "h2d_gbps", "must be > 0")

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.bytes_per_token


@dataclass
class LocalPass:
    """Per request: its instance, and the prompt tokens HBM and host memory served."""

    instance: np.ndarray
    device_tokens: np.ndarray
    host_tokens: np.ndarray
    local_blocks: list[int] = field(default_factory=list)  # leading blocks served from HBM or host memory
    evicted: tuple[int, int] = (0, 0)  # blocks HBM and host memory dropped for room


@dataclass
class L3Pass:
    """Per request: prompt tokens the L3 served and tokens written to it; blocks it dropped for room."""

    storage_tokens: np.ndarray
    written_tokens: np.ndarray
    evicted: int


def cacheable_sizes(trace: Trace, page_tokens: int) -> list[list[int]]:
    """Tokens each block can hold in the cache: whole pages only (a partial last page is never cached)."""
    return [[s - s % page_tokens for s in trace.block_sizes(r)] for r in trace.requests]


def local_pass(trace: Trace, dep: Deployment, sizes: list[list[int]], host: bool = True,
               flushes: Sequence[float] = ()) -> LocalPass:
    """HBM and (with ``host``) host memory of every instance over the whole trace; emptied (SGLang's
    ``/flush_cache``) before the first request arriving at or after each time in ``flushes``."""
    n = len(trace.requests)
    pending = sorted(flushes)

    def fresh() -> tuple[list[Tier], list[Tier]]:
        return ([Tier(dep.hbm_tokens, dep.eviction) for _ in range(dep.instances)],
                [Tier(dep.host_tokens if host else 0, dep.eviction) for _ in range(dep.instances)])

    l1, l2 = fresh()
    evicted = [0, 0]
    recent: list[deque[float]] = [deque() for _ in range(dep.instances)]
    out = LocalPass(np.zeros(n, np.int32), np.zeros(n, np.int64), np.zeros(n, np.int64))
    for i, req in enumerate(trace.requests):
        blocks, size = req.blocks, sizes[i]
        if pending and req.arrival_s >= pending[0]:
            while pending and req.arrival_s >= pending[0]:
                pending.pop(0)
            evicted = [evicted[0] + sum(t.evicted for t in l1), evicted[1] + sum(t.evicted for t in l2)]
            l1, l2 = fresh()
        if dep.routing is Routing.ROUND_ROBIN:
            inst = i % dep.instances
            d, h = _local_prefix(l1[inst], l2[inst], blocks)
        else:
            inst, d, h = _cache_aware(l1, l2, blocks, size, req.input_tokens, recent, req.arrival_s)
        recent[inst].append(req.arrival_s)
        out.instance[i] = inst
        out.device_tokens[i] = sum(size[:d])
        out.host_tokens[i] = sum(size[d:d + h])
        out.local_blocks.append(d + h)
        l1[inst].admit(blocks, size)
        l2[inst].admit(blocks, size)
    out.evicted = (evicted[0] + sum(t.evicted for t in l1), evicted[1] + sum(t.evicted for t in l2))
    return out


def _cache_aware(l1: list[Tier], l2: list[Tier], blocks: tuple[int, ...], size: list[int], tokens: int,
                 recent: list[deque[float]], now: float) -> tuple[int, int, int]:
    """(instance, HBM blocks, host blocks) as SGLang's cache-aware router picks the instance."""
    for q in recent:
        while q and q[0] < now - LOAD_WINDOW_S:
            q.popleft()
    load = [len(q) for q in recent]
    least = min(range(len(load)), key=load.__getitem__)
    if max(load) - load[least] > BALANCE_ABS and max(load) > BALANCE_REL * load[least]:
        return (least, *_local_prefix(l1[least], l2[least], blocks))
    best, best_tokens, best_dh = least, -1, (0, 0)
    for j in range(len(l1)):
        d, h = _local_prefix(l1[j], l2[j], blocks)
        matched = sum(size[:d + h])
        if matched > best_tokens or (matched == best_tokens and load[j] < load[best]):
            best, best_tokens, best_dh = j, matched, (d, h)
    if best_tokens >= CACHE_THRESHOLD * max(tokens, 1):
        return (best, *best_dh)
    return (least, *_local_prefix(l1[least], l2[least], blocks))


def _local_prefix(l1: Tier, l2: Tier, blocks: tuple[int, ...]) -> tuple[int, int]:
    d = l1.prefix(blocks)
    n = d
    while n < len(blocks) and (blocks[n] in l2 or blocks[n] in l1):
        n += 1
    return d, n - d


def l3_pass(trace: Trace, dep: Deployment, sizes: list[list[int]], local: LocalPass, capacity_bytes: float,
            mode: PoolMode) -> L3Pass:
    """The L3 of ``capacity_bytes`` in all (split evenly per instance in ``PER_INSTANCE`` mode) on top of
    ``local``: a request reads the blocks after its local prefix that the L3 holds, as SGLang prefetches
    them (``prefetches``); what it computes is written."""
    pools = 1 if mode is PoolMode.SHARED else dep.instances
    per_pool = int(capacity_bytes / pools // dep.bytes_per_token)
    tiers = [Tier(per_pool, dep.eviction) for _ in range(pools)]
    n = len(trace.requests)
    out = L3Pass(np.zeros(n, np.int64), np.zeros(n, np.int64), 0)
    inflight: list[list[tuple[float, int]]] = [[] for _ in range(dep.instances)]  # (load end, tokens) per instance
    for i, req in enumerate(trace.requests):
        inst = int(local.instance[i])
        tier = tiers[0 if pools == 1 else inst]
        blocks, size, k = req.blocks, sizes[i], local.local_blocks[i]
        s = tier.prefix(blocks, k)
        hit = sum(size[k:k + s])
        if s and prefetches(dep, sum(size[k:]), hit, inflight[inst], req.arrival_s):
            tier.touch(blocks[k:k + s])
            out.storage_tokens[i] = hit
            inflight[inst].append((req.arrival_s + dep.array.load_time(hit // dep.page_tokens, dep.page_bytes), hit))
        else:
            s = 0
        m = k + s
        if m < len(blocks):
            out.written_tokens[i] = tier.admit(blocks[m:], size[m:], blocks[m - 1] if m else None)
    out.evicted = sum(t.evicted for t in tiers)
    return out


def prefetches(dep: Deployment, span: int, hit: int, inflight: list[tuple[float, int]], now: float) -> bool:
    """Whether SGLang loads an L3 hit of ``hit`` tokens for a prompt whose uncached rest is ``span`` tokens:
    not when the span or the hit is below ``prefetch_threshold_tokens``, nor while the instance's prefetches
    in flight (``inflight``, pruned here) reserve half its host pool or more (``prefetch_rate_limited``)."""
    inflight[:] = [(end, t) for end, t in inflight if end > now]
    if span < dep.prefetch_threshold_tokens or hit < dep.prefetch_threshold_tokens:
        return False
    return sum(t for _, t in inflight) < PREFETCH_HOST_SHARE * dep.host_tokens


@dataclass
class Timeline:
    """Per request: time to first token (s) and when its prompt was ready to prefill (s from the start)."""

    ttft_s: np.ndarray
    ready_s: np.ndarray


def timeline(trace: Trace, dep: Deployment, instance: np.ndarray, cached: np.ndarray, loaded: np.ndarray,
             from_host: np.ndarray) -> Timeline:
    """Queue each instance's prefills: ``cached`` prompt tokens need no prefill, of which ``loaded`` come
    from the L3 (read while the request waits) and ``from_host`` + ``loaded`` cross to HBM. A forward takes
    every prompt ready when it starts, as SGLang's scheduler batches them (up to ``MAX_PREFILL_TOKENS`` new
    tokens, and prompts that fit the HBM pool together); each gets its first token when the forward ends."""
    n = len(trace.requests)
    arrival = np.array([r.arrival_s for r in trace.requests])
    inputs = np.array([r.input_tokens for r in trace.requests], np.int64)
    load = np.fromiter((dep.array.load_time(int(p), dep.page_bytes) for p in loaded // dep.page_tokens), float, n)
    ready = arrival + load
    t = np.maximum(inputs - cached, 1)
    pm = dep.prefill
    work = np.fromiter((pm.time(int(new), int(old)) - pm.fixed_s for new, old in zip(t, cached)), float, n)
    work = work + (from_host + loaded) * dep.bytes_per_token / dep.h2d_Bps  # the fixed cost: once a forward
    done = np.zeros(len(arrival))
    room = dep.hbm_tokens if dep.hbm_tokens > 0 else np.inf
    for inst in range(dep.instances):
        idx = np.flatnonzero(instance == inst)
        idx = idx[np.argsort(ready[idx], kind="stable")].tolist()
        free, i = 0.0, 0
        while i < len(idx):
            start = max(free, ready[idx[i]])
            end, new, held = start + pm.fixed_s + work[idx[i]], int(t[idx[i]]), int(inputs[idx[i]])
            j = i + 1
            while (j < len(idx) and ready[idx[j]] <= start and new + t[idx[j]] <= MAX_PREFILL_TOKENS
                   and held + inputs[idx[j]] <= room):
                end += work[idx[j]]
                new, held = new + int(t[idx[j]]), held + int(inputs[idx[j]])
                j += 1
            done[idx[i:j]] = end
            free, i = end, j
    return Timeline(done - arrival, ready)


def break_even_tokens(dep: Deployment, limit: int = 1 << 21) -> int | None:
    """The shortest prefix (whole pages, up to ``limit`` tokens) that loads from the L3 faster than it
    recomputes from nothing; None if none does."""
    for pages in range(1, limit // dep.page_tokens + 1):
        tokens = pages * dep.page_tokens
        load = dep.array.load_time(pages, dep.page_bytes) + tokens * dep.bytes_per_token / dep.h2d_Bps
        if load < dep.prefill.time(tokens, 0):
            return tokens
    return None


def peak_rate(times: np.ndarray, amounts: np.ndarray, window_s: float = 1.0) -> float:
    """The largest sum of ``amounts`` over any ``window_s`` window starting at a whole multiple of it, per second."""
    if not len(times) or not amounts.any():
        return 0.0
    buckets = np.floor(times / window_s).astype(np.int64)
    return float(np.bincount(buckets - buckets.min(), weights=amounts).max() / window_s)


def percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan
