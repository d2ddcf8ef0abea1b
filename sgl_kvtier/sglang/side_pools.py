"""``batch_exists_v2`` for side pools (Mamba/SWA state, DSA indexer, draft KV), served by their host shards.

The same fold as SGLang's ``HiCacheFile.batch_exists_v2``: the KV prefix is the longest run of stored KV
pages; each pool then restricts which prefix lengths are restorable:
  ALL_PAGES       every page of the prefix must be stored for that pool;
  TRAILING_PAGES  only the last ``len(transfer.keys)`` pages of the prefix must be stored;
  BLOCK_GROUPS    the pool reports the whole groups it holds from the start; it never gates the KV hit.
The usable hit is the longest prefix restorable for every gating pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer, PoolTransferResult

from sgl_kvtier.keys import PageKey
from sgl_kvtier.sglang.host_shard import HostShard


def exists_v2(kv: HostShard | None, shards: Mapping[str, HostShard], keys: Sequence[PageKey],
              transfers: Sequence[PoolTransfer]) -> PoolTransferResult:
    """The usable hit of ``keys``: the stored KV prefix, cut to what every gating side pool can restore
    (``shards``: the host shard of each pool, by name)."""
    kv_pages = kv.longest_prefix(keys) if kv is not None else 0
    hit_count: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for transfer in transfers:
        if not restorable:
            break
        name = str(transfer.name)
        shard = shards.get(name)
        has = [shard is not None and shard.contains(keys[i]) for i in range(kv_pages)]
        if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
            group = max(1, transfer.group_pages or 1)
            full = next((i for i, h in enumerate(has) if not h), kv_pages)
            if full // group * group:
                hit_count[name] = full // group * group
            continue
        if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
            boundary = next((i for i, h in enumerate(has) if not h), kv_pages)
            allowed = set(range(1, boundary + 1))
        else:
            trailing = max(1, len(transfer.keys) if transfer.keys else 1)
            allowed = {p for p in range(1, kv_pages + 1) if all(has[max(0, p - trailing):p])}
        boundary = max(allowed, default=0)
        if boundary:
            hit_count[name] = boundary
        restorable = [p for p in restorable if p in allowed]
    return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)
