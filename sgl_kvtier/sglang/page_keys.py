"""The page keys SGLang hands the backend, as ours: hex key strings to ``PageKey`` (a bad key ends a run or
reads as a miss), the parent of a batch from ``extra_info.prefix_keys``, and SGLang's page-hash extension
warmed at start-up (the keys come from it).

Rules: ``keys_or_none`` keeps positions (None where a key does not parse: that page is a miss);
``keys_until_invalid`` stops at the first bad key (a hit is a leading run); ``parent_of`` is None when SGLang
passed no prefix keys (``hicache_storage_pass_prefix_keys`` off) or the last one does not parse. Nothing
here raises on SGLang's input.
"""

from __future__ import annotations

import logging
import time

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from sgl_kvtier.keys import PageKey, parse_key

log = logging.getLogger(__name__)


def warm_page_hash() -> None:
    """Load SGLang's native page-hash extension now, at start-up, not at the first L3 lookup.

    SGLang loads it lazily at its first page hash, in a fresh server the prefetch thread's first lookup: a
    torch JIT load (possibly a rebuild) inside that request's prefetch deadline, which can then expire with
    nothing loaded, losing a storage hit. Loaded once per process (SGLang caches it). A failure is logged,
    never raised: SGLang reports it at its own first hash."""
    start = time.perf_counter()
    try:
        from sglang.srt.mem_cache.utils import get_hash_str

        get_hash_str([0])
    except Exception as exc:  # no compiler, a broken cache directory: SGLang's first hash says so again
        log.warning("kvtier: SGLang's page hash did not load at start-up (%r); it loads at the first lookup", exc)
        return
    elapsed = time.perf_counter() - start
    if elapsed > 1.0:
        log.info("kvtier: SGLang's page hash extension loaded at start-up in %.1f s", elapsed)


def keys_or_none(keys: list[str]) -> list[PageKey | None]:
    """Each key parsed, None where it does not parse (positions kept)."""
    out: list[PageKey | None] = []
    for k in keys:
        try:
            out.append(parse_key(k))
        except ValueError:
            out.append(None)
    return out


def keys_until_invalid(keys: list[str]) -> list[PageKey]:
    """The leading run of keys that parse."""
    out = []
    for k in keys_or_none(keys):
        if k is None:
            break
        out.append(k)
    return out


def prefix_keys(extra_info: HiCacheStorageExtraInfo | None) -> list[str]:
    """The keys of the pages before this batch, as SGLang passed them (empty: none passed)."""
    return list(extra_info.prefix_keys or ()) if extra_info is not None else []


def parent_of(extra_info: HiCacheStorageExtraInfo | None) -> PageKey | None:
    """The key of the page right before this batch (None: unknown)."""
    prefix = prefix_keys(extra_info)
    if not prefix:
        return None
    try:
        return parse_key(prefix[-1])
    except ValueError:
        return None
