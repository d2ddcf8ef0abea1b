"""One SGLang host pool bound to its page-store shard: SGLang's call shapes in, store calls out.

Writers open the shard read-write. Ranks that only read a replicated (MLA) shard open it read-only,
lazily: the writer rank may not have created it yet, so a failed open is retried on later calls.
Each open store gets a read-ahead stage (``config.readahead_bytes``; 0 = none): ``stage`` starts the
reads of pages an exists query found, and every read of this tier goes through it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import DeviceError, KVTierError
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.prefetch import ReadAhead
from sgl_kvtier.sglang.host_pages import Access, HostPages, check_indices, tensor_run
from sgl_kvtier.sglang.settings import namespace_for
from sgl_kvtier.store import PageStore

log = logging.getLogger(__name__)
READER_RETRY_S = 5.0


@dataclass
class PoolTier:
    name: str
    pages: HostPages
    namespace: Namespace
    config: StoreConfig
    writer: bool
    store: PageStore | None = None
    readahead: ReadAhead | None = None
    _next_open: float = field(default=0.0, repr=False)

    @classmethod
    def open(cls, name: str, pages: HostPages, storage_config: Any, config: StoreConfig, writer: bool) -> "PoolTier":
        tier = cls(name, pages, namespace_for(storage_config, pages, name), config, writer)
        if writer:
            tier._attach(PageStore.open(config, tier.namespace))  # errors here stop start-up, as they should
        else:
            tier._reader()
        return tier

    def _reader(self) -> PageStore | None:
        if self.store is None and time.monotonic() >= self._next_open:
            try:
                self._attach(PageStore.open(self.config, self.namespace, readonly=True))
            except DeviceError:  # not created by the writer rank yet
                self._next_open = time.monotonic() + READER_RETRY_S
        return self.store

    def _attach(self, store: PageStore) -> None:
        self.store = store
        if self.config.readahead_bytes >= self.pages.page_bytes:
            # Chunks of io_depth pages: each staging job keeps the device queue full, and a span's first
            # pages are ready before its last ones are read.
            self.readahead = ReadAhead(store.get, self.pages.page_bytes, self.config.readahead_bytes,
                                       chunk_pages=self.config.io_depth)

    def _store(self) -> PageStore:
        store = self.store if self.writer else self._reader()
        if store is None:
            raise KVTierError(f"shard {self.namespace.dirname()} does not exist yet")
        return store

    # ------------------------------------------------------------------ queries
    def longest_prefix(self, keys: Sequence[PageKey]) -> int:
        store = self.store if self.writer else self._reader()
        if store is None:
            return 0
        n = store.longest_prefix(keys)
        if n < len(keys) and not self.writer and store.refresh():  # the writer rank may have added pages
            n = store.longest_prefix(keys)
        return n

    def stage(self, keys: Sequence[PageKey]) -> int:
        """Start reading ``keys`` (an exists query's hit) into staging; how many reads started."""
        return 0 if self.readahead is None else self.readahead.stage(keys)

    def _get(self, store: PageStore, keys: Sequence[PageKey], runs: Sequence[Sequence]) -> list[bool]:
        return store.get(keys, runs) if self.readahead is None else self.readahead.read(keys, runs)

    def contains(self, key: PageKey) -> bool:
        return self.store is not None and self.store.contains(key)

    # ------------------------------------------------------------------ host-index transfers
    def read(self, keys: Sequence[PageKey | None], host_indices: torch.Tensor) -> list[bool]:
        """Read the leading readable run of ``keys`` into the pool; SGLang only uses that run."""
        _check(host_indices, len(keys), self.pages.page_tokens)
        store = self._store()
        valid = []
        for k in keys:
            if k is None:
                break
            valid.append(k)
        n = store.longest_prefix(valid)
        if n == 0:
            return [False] * len(keys)
        span = host_indices[:n * self.pages.page_tokens]
        if self.pages.access is Access.ZERO_COPY:
            oks = self._get(store, valid[:n], self.pages.page_runs(span))
        else:
            flats = [self.pages.pool.get_dummy_flat_data_page() for _ in range(n)]
            oks = self._get(store, valid[:n], [[tensor_run(f)] for f in flats])
            for start, flat, ok in zip(self.pages.page_starts(span), flats, oks):
                if ok:
                    self.pages.pool.set_from_flat_data_page(start, flat)
        return oks + [False] * (len(keys) - n)

    def write(self, keys: Sequence[PageKey | None], host_indices: torch.Tensor, parent: PageKey | None) -> list[bool]:
        _check(host_indices, len(keys), self.pages.page_tokens)
        if self.pages.access is Access.ZERO_COPY:
            runs = self.pages.page_runs(host_indices)
            keepalive: list[torch.Tensor] = []
        else:
            keepalive = [self.pages.pool.get_data_page(s, flat=True).contiguous()
                         for s in self.pages.page_starts(host_indices)]
            runs = [[tensor_run(t)] for t in keepalive]
        return self._put(keys, runs, parent)

    # ------------------------------------------------------------------ flat tensors (legacy API)
    def read_flat(self, keys: Sequence[PageKey | None], tensors: list[torch.Tensor]) -> list[bool]:
        store = self._store()
        idx = [i for i, (k, t) in enumerate(zip(keys, tensors)) if k is not None and self._fits(t)]
        oks = self._get(store, [keys[i] for i in idx], [[tensor_run(tensors[i])] for i in idx])
        out = [False] * len(keys)
        for i, ok in zip(idx, oks):
            out[i] = ok
        return out

    def write_flat(self, keys: Sequence[PageKey | None], tensors: list[torch.Tensor]) -> list[bool]:
        ok_shape = [t is not None and self._fits(t) for t in tensors]
        runs = [[tensor_run(t.contiguous())] if fits else [] for t, fits in zip(tensors, ok_shape)]
        return [ok and fits for ok, fits in zip(self._put(keys, runs, None), ok_shape)]

    def _fits(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and t.numel() * t.element_size() == self.pages.page_bytes

    def _put(self, keys: Sequence[PageKey | None], runs: list, parent: PageKey | None) -> list[bool]:
        store = self._store()
        idx = [i for i, k in enumerate(keys) if k is not None]
        oks = store.put([keys[i] for i in idx], [runs[i] for i in idx],
                        parent if idx and idx[0] == 0 else None)
        out = [False] * len(keys)
        for i, ok in zip(idx, oks):
            out[i] = ok
        return out

    def clear(self) -> None:
        if self.store is not None and self.writer:
            self.store.clear()

    def close(self) -> None:
        if self.readahead is not None:
            self.readahead.close()  # before the store: its jobs read from it
            self.readahead = None
        if self.store is not None:
            self.store.close()
            self.store = None


def _check(host_indices: Any, n_keys: int, page_tokens: int) -> None:
    problem = check_indices(host_indices, n_keys, page_tokens)
    if problem is not None:
        raise ValueError(problem)
