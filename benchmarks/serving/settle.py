"""Between two rounds of an L3 benchmark (``bench_policy``, ``bench_streaming``): the L3 write-back drained, L1 +
L2 flushed and the OS page cache dropped, so every prefix of the rounds before is in L3 only.

Ordering: the write-back is waited for *before* the flush (a flush while pages still wait for L3 would lose
them), and the page cache is dropped after it (the flush itself writes nothing to the devices).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console

from benchmarks.common import drop_caches
from sgl_kvtier.serving import client


def wait_l3(url: str, want: float, limit_s: float, stall_s: float) -> dict[str, Any]:
    """`client.wait_backups` until `want` tokens are backed up, giving up after `limit_s` or as soon as the
    count has not moved for `stall_s` (SGLang drops a host backup for good when the host pool is full of
    pages still waiting for L3: those tokens never arrive)."""
    t0, last, seen = time.monotonic(), None, {}
    while time.monotonic() - t0 < limit_s:
        seen = client.wait_backups(url, want, min(stall_s, limit_s))
        if seen["settled"] or seen["backuped_tokens"] == last:
            break
        last = seen["backuped_tokens"]
    return seen | {"waited_s": round(time.monotonic() - t0, 2)}


def settle(args: argparse.Namespace, srv: Any, unique: list[int], i: int, base: float, drop: bool,
           console: Console) -> dict[str, Any]:
    """Before round i > 0: every page of rounds < i backed up to L3 (``unique``: cumulative distinct tokens
    after each round; ``base``: the backed-up count before round 0), L1 + L2 flushed, page cache dropped.
    ``args.backup_wait`` / ``args.backup_stall`` bound the wait."""
    out: dict[str, Any] = {"backups": wait_l3(srv.url, base + unique[i - 1], args.backup_wait, args.backup_stall)}
    if not out["backups"]["settled"]:
        console.log(f"[yellow]L3 write-back stopped at {out['backups']['backuped_tokens']:.0f} of "
                    f"{base + unique[i - 1]:.0f} tokens: some prefixes are not in L3 (host pool too small?)[/]")
    out["flush_s"] = srv.flush_cache(timeout_s=max(120.0, args.backup_wait))
    if drop:
        out["drop_caches_s"] = drop_caches()
    return out
