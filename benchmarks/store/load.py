"""The exists -> get span of a prefetch as SGLang 0.5.23 runs it, for ``bench_backends --readahead``.

SGLang's prefetch thread asks ``batch_exists`` about a request's uncached span, ``STORAGE_BATCH_SIZE`` (128)
keys a call, stopping at the first partial hit (``HiCacheController._storage_hit_query``); its IO thread
then calls ``batch_get_v1`` for the hit, 128 pages a call, one after another (``_page_transfer``). With
read-ahead on, kvtier's ``batch_exists`` already starts reading the pages it reports, so what the request
waits for is the whole span, from the first exists call to the last get. This module times that span on
a freshly opened backend with a cold page cache, once with ``readahead_bytes`` on (``--readahead-bytes``,
256 MiB unless told; the store's default is 0, off) and once with 0, on the same stored pages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageExtraInfo

from benchmarks.store.backends import close, page_equal, readahead_counters, slot_indices, zero_pages
from benchmarks.store.context import BATCH, Ctx

READAHEAD_ON = 256 << 20  # the budget read-ahead is measured with unless --readahead-bytes says otherwise


def load_span(ctx: Ctx, backend, io, keys: list[str], last_src, pool, gap_s: float) -> dict[str, Any]:
    """Time exists (128 keys a call) then the 128-page gets of the whole hit, as one span.

    The gets reuse one set of scattered landing slots, so nothing but the calls runs inside the span; each
    call must return every page (kvtier verifies each page's checksum), and the last batch is compared bit
    for bit with its source pages afterwards. ``gap_s`` stands for the scheduler step SGLang runs between
    the hit query and the IO thread's first get (0: none, the least read-ahead can overlap)."""
    landing = ctx.rng.permutation(BATCH) + 2 * BATCH
    zero_pages(pool, landing)
    info = HiCacheStorageExtraInfo(prefix_keys=None)  # SGLang passes None unless pass_prefix_keys is set
    t0 = time.perf_counter()
    hit = 0
    for start in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[start:start + STORAGE_BATCH_SIZE]
        found = backend.batch_exists(batch, info)
        hit += found
        if found < len(batch):
            break
    exists_s = time.perf_counter() - t0
    if hit != len(keys):
        raise RuntimeError(f"load span: batch_exists found {hit} of {len(keys)} stored keys")
    if gap_s:
        time.sleep(gap_s)  # a modelled scheduler step inside the timed span, not synchronisation
    host = slot_indices(landing)
    for b in range(0, len(keys), BATCH):
        got = io.get(keys[b:b + BATCH], host, info)
        if got != len(keys[b:b + BATCH]):
            raise RuntimeError(f"load span: batch {b // BATCH} returned {got} of {BATCH} pages")
    span_s = time.perf_counter() - t0
    if not all(page_equal(pool, int(landing[i]), int(last_src[i])) for i in range(got)):
        raise RuntimeError("load span: the last batch read back differs from what was written")
    return {"span_s": span_s, "exists_ms": exists_s * 1e3, "readahead": readahead_counters(backend)}


def measure_loads(ctx: Ctx, opener: Callable[..., tuple], keys: list[str], last_src, pool, nbytes: int,
                  reverse: bool) -> dict[str, dict[str, Any]]:
    """The span with read-ahead on (``ctx.args.readahead_bytes``) and off (``reverse`` swaps who goes first),
    each on a backend reopened after dropping the page cache; {row system: {"load" GB/s, "note", ...}}."""
    out = {}
    settings = (("kvtier+ra", int(ctx.args.readahead_bytes)), ("kvtier", 0))
    for system, readahead in settings[::-1] if reverse else settings:
        ctx.drop_caches()
        backend, io = opener(readahead_bytes=readahead)
        try:
            res = load_span(ctx, backend, io, keys, last_src, pool, ctx.args.load_gap_ms / 1e3)
        finally:
            close(backend)
        counts = ", ".join(f"{k} {v}" for k, v in res["readahead"].items() if k in ("staged", "served", "joined",
                                                                                   "skipped_full"))
        out[system] = {**res, "load": nbytes / res["span_s"] / 1e9,
                       "note": f"readahead_bytes={readahead}; exists "
                               f"{res['exists_ms']:.1f} ms of {res['span_s'] * 1e3:.0f} ms"
                               + (f"; {counts}" if counts else "")}
    return out
