"""``batch_exists_v2`` for side pools (Mamba/SWA state, DSA indexer, draft KV), served by their host shards.

The same fold as SGLang's ``HiCacheFile.batch_exists_v2``: the KV prefix is the longest run of stored KV
pages; each pool then restricts which prefix lengths are restorable:
  ALL_PAGES       every page of the prefix must be stored for that pool;
  TRAILING_PAGES  only the last ``len(transfer.keys)`` pages of the prefix must be stored;
  BLOCK_GROUPS    the pool reports the whole groups it holds from the start; it never gates the KV hit.
The usable hit is the longest prefix restorable for every gating pool.

Other writers' commits: each pool is read as the v1 query reads the KV pool (``sharing.shortfall``), so a
pool whose answer falls short (the KV prefix short of the keys; a side pool holding less than that prefix
needs of it) re-reads its other writers first, always on a retry: a retry after a miss sees what another
writer committed since, in every pool the answer depends on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer, PoolTransferResult

from sgl_kvtier.keys import PageKey
from sgl_kvtier.sglang.host_shard import HostShard


def exists_v2(kv: HostShard | None, shards: Mapping[str, HostShard], keys: Sequence[PageKey],
              transfers: Sequence[PoolTransfer]) -> PoolTransferResult:
    """The usable hit of ``keys``: the stored KV prefix, cut to what every gating side pool can restore
    (``shards``: the host shard of each pool, by name).

    Each pool's answer follows the one shortfall rule of the v1 query (``sharing.shortfall``): the KV pool's
    prefix short of ``keys``, or a side pool holding less than the KV prefix needs of it, re-reads that pool's
    other writers first (a retry always), and the pool is asked again."""
    kv_pages = kv.longest_prefix(keys) if kv is not None else 0  # (the KV pool applies the rule itself)
    hit_count: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    asked = keys[:kv_pages]
    for transfer in transfers:
        if not restorable:
            break
        name = str(transfer.name)
        shard = shards.get(name)
        has = [False] * kv_pages if shard is None else shard.present(asked)
        allowed, hit, whole = _pool_hit(transfer, has, kv_pages)
        if hit < whole and shard is not None and shard.shortfall(asked):
            allowed, hit, whole = _pool_hit(transfer, shard.present(asked), kv_pages)
        if hit:
            hit_count[name] = hit
        if allowed is not None:
            restorable = [p for p in restorable if p in allowed]
    return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)


def _pool_hit(transfer: PoolTransfer, has: list[bool], kv_pages: int) -> tuple[set[int] | None, int, int]:
    """One side pool's answer for a KV prefix of ``kv_pages`` pages, ``has`` saying which of them it holds:
    the prefix lengths it can restore (None: it never gates), its hit, and the hit it would have holding
    every page (less than that: the pool fell short)."""
    if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
        group = max(1, transfer.group_pages or 1)
        full = next((i for i, h in enumerate(has) if not h), kv_pages)
        return None, full // group * group, kv_pages // group * group
    if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
        boundary = next((i for i, h in enumerate(has) if not h), kv_pages)
        allowed = set(range(1, boundary + 1))
    else:
        trailing = max(1, len(transfer.keys) if transfer.keys else 1)
        allowed = {p for p in range(1, kv_pages + 1) if all(has[max(0, p - trailing):p])}
    return allowed, max(allowed, default=0), kv_pages
