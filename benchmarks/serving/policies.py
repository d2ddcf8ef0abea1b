"""bench_policy's axes: the four L3 prefetch policies, the device settings, and the prefix-round workload.

Every policy runs the same server (the `kvtier-l3` configuration of `configs`: HiCache + sgl-kvtier L3,
SGLang's `write_through` backups) and differs only in what decides whether a stored prefix is loaded:

- `recompute`: the L3 is attached and written, never loaded: `prefetch_threshold` above any prompt, so
  SGLang never queries it for a prefetch. Same pools, same radix/host caching and same write-back
  traffic as the others; only the loads are gone.
- `load-all`: `--hicache-storage-prefetch-policy wait_complete`: every stored page is loaded, however long.
- `timeout`: SGLang's default policy with its default budget (1 s + 0.25 s per 1k prefix tokens).
- `cost`: `timeout` + `KVTIER_PREFETCH_POLICY=cost` (our load-or-recompute model replaces the budget).
The other policies get `KVTIER_PREFETCH_POLICY=off`, so the caller's environment cannot switch it on.

A device setting is `fast` (the L3 directory as it is) or `slow:R[:W]` (sgl-kvtier's ThrottledEngine:
reads capped at R MB/s, writes at W MB/s, default W = R, plus a fixed latency per IO).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.serving import workloads

NEVER_PREFETCH = 1 << 30  # prefetch_threshold in tokens: above any prompt, so no L3 lookup is ever made
# A throttled device is slow by design; the circuit breaker (2 s per IO by default) must not take it for a
# failing one, or it would turn the slow run into a no-L3 run.
SLOW_IO_S = 600.0


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    summary: str
    server_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    kvtier_extra: tuple[tuple[str, Any], ...] = ()


_TIMEOUT = ("--hicache-storage-prefetch-policy", "timeout")
POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("recompute", "L3 written, never loaded (prefetch_threshold above any prompt)", _TIMEOUT,
           (("KVTIER_PREFETCH_POLICY", "off"),), (("prefetch_threshold", NEVER_PREFETCH),)),
    Policy("load-all", "--hicache-storage-prefetch-policy wait_complete: load every stored page",
           ("--hicache-storage-prefetch-policy", "wait_complete"), (("KVTIER_PREFETCH_POLICY", "off"),)),
    Policy("timeout", "SGLang's default timeout policy, default budget (1 s + 0.25 s per 1k tokens)", _TIMEOUT,
           (("KVTIER_PREFETCH_POLICY", "off"),)),
    Policy("cost", "timeout + KVTIER_PREFETCH_POLICY=cost (sgl-kvtier's load-or-recompute model)", _TIMEOUT,
           (("KVTIER_PREFETCH_POLICY", "cost"),)),
)}  # fmt: skip
BASELINES = ("recompute", "load-all")  # the target: cost <= 1.1x the better of these two


def resolve_policies(names: list[str]) -> list[Policy]:
    """Policies by name, in POLICIES order, duplicates dropped."""
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; choose from {list(POLICIES)}")
    return [p for n, p in POLICIES.items() if n in names]


@dataclasses.dataclass(frozen=True)
class DeviceSetting:
    name: str
    read_mbps: float | None = None  # None: not throttled
    write_mbps: float | None = None
    latency_ms: float = 0.0

    @property
    def throttle(self) -> dict[str, float] | None:
        if self.read_mbps is None:
            return None
        return {"read_bytes_per_s": self.read_mbps * 1e6, "write_bytes_per_s": (self.write_mbps or self.read_mbps) * 1e6,
                "latency_s": self.latency_ms / 1000}

    def kvtier_extra(self) -> dict[str, Any]:
        t = self.throttle
        return {} if t is None else {"throttle": t, "slow_io_s": SLOW_IO_S}

    def describe(self) -> str:
        if self.read_mbps is None:
            return "fast: the L3 directory's own device, unthrottled"
        return (f"slow: reads {self.read_mbps:g} MB/s, writes {self.write_mbps or self.read_mbps:g} MB/s, "
                f"+{self.latency_ms:g} ms per IO (ThrottledEngine)")


def parse_device(spec: str, latency_ms: float) -> DeviceSetting:
    """`fast` or `slow:R[:W]` (MB/s, 1 MB = 1e6 bytes)."""
    if spec == "fast":
        return DeviceSetting("fast")
    parts = spec.split(":")
    try:
        if parts[0] != "slow" or len(parts) not in (2, 3):
            raise ValueError
        read = float(parts[1])
        write = float(parts[2]) if len(parts) == 3 else read
        if read <= 0 or write <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"device setting {spec!r}: expected 'fast' or 'slow:READ_MBPS[:WRITE_MBPS]'") from None
    name = f"slow-{read:g}MBps" + (f"-w{write:g}" if write != read else "")
    return DeviceSetting(name, read, write, latency_ms)


@dataclasses.dataclass
class Round:
    """One phase of requests and what the harness does with it."""

    kind: str  # "write" (fills L3), "prime" (first loads, unmeasured), "measured"
    concurrency: int
    requests: list[workloads.Request]


def prefix_rounds(src: workloads.TokenSource, *, documents: int, doc_tokens: int, question_tokens: int,
                  concurrency: list[int], rounds: int, prime_rounds: int, max_new_tokens: int) -> list[Round]:
    """A write round, `prime_rounds` unmeasured rounds, then `rounds` measured rounds per concurrency level.

    Round i asks question i of every document (prompt = document + question): each round has one request
    per document, so within a round no request shares a prefix with another, and (with L1 and L2 flushed
    before every round after the write round) every document prefix is in L3 only when its request
    arrives. The question suffix is always computed. Built from `workloads.docqa`.
    """
    per_level = [c for c in concurrency for _ in range(rounds)]
    total = 1 + prime_rounds + len(per_level)
    wl = workloads.docqa(src, documents=documents, doc_tokens=doc_tokens, questions=total,
                         question_tokens=question_tokens, max_new_tokens=max_new_tokens)
    later = wl.phases[1]  # question-major: one request per document per question
    chunks = [later[i:i + documents] for i in range(0, len(later), documents)]
    top = max(concurrency)
    out = [Round("write", top, wl.phases[0])]
    out += [Round("prime", min(concurrency), chunks[i]) for i in range(prime_rounds)]
    out += [Round("measured", c, chunks[prime_rounds + i]) for i, c in enumerate(per_level)]
    return out


def unique_tokens(rounds: list[Round], page: int) -> list[int]:
    """Distinct whole-page prefix tokens after each round, cumulative (what L3 holds once backed up)."""
    wl = workloads.Workload("prefix-rounds", [r.requests for r in rounds], {}, "")
    return wl.unique_tokens(page)
