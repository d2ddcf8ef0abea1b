"""HostShards: a backend's host shards, one per host pool SGLang registers, under one byte limit.

Registration (``register``): SGLang hands the KV pool to ``register_mem_pool_host``, then every pool of its
``HostPoolGroup`` to ``register_mem_host_pool_v2``, the KV pool again among them (as ``"kv"``). A pool is
*served* (bound to a host shard of its own, ``"kv"`` being the KV pool's) or *refused* with
``UnservedPoolError`` naming it: a second, different pool under a name already registered, or a pool whose
pages cannot be described (``HostPages.of``). Nothing is ignored; a refusal fails its attach, and the backend
releases whatever it opened and serves nothing.

Opening: the KV host shard opens when ``register_mem_pool_host`` binds it (inside SGLang's guarded attach),
provisionally with the whole limit; on raw block devices, whose regions keep the size of their first claim,
it waits for the final split instead. Once all pools are known (``open_all``; or the first call that needs a
store, ``ready``) every host shard opens under its share of the limit (``capacity``), an open one reopening
when its share changed; a pool registered later changes every share again. The opened capacities are
checked never to add up to more than the limit. A failed open releases every host shard and propagates.

Closing (``close``): every host shard is closed whatever the others raise; the failures are returned, in
order, for the caller's boundary to report.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import KVTierError
from sgl_kvtier.sglang.capacity import backend_limit, split
from sgl_kvtier.sglang.host_pages import HostPages
from sgl_kvtier.sglang.host_shard import HostShard
from sgl_kvtier.store.devices import is_block_like
from sgl_kvtier.store.lifecycle import Failure, abandon, run_steps

log = logging.getLogger(__name__)
KV = "kv"


class UnservedPoolError(KVTierError):
    """A host pool SGLang registered that this backend does not serve; the message names the pool and why."""

    def __init__(self, name: str, pool: Any, why: str):
        self.pool_name = name
        super().__init__(f"host pool {name!r} ({type(pool).__name__}) is not served: {why}")


class HostShards:
    """The host shards of one backend by pool name (``kv``: the KV pool's), their capacity split, open and close."""

    def __init__(self, storage_config: Any, config: StoreConfig, writer: bool):
        self.storage_config = storage_config
        self.config = config
        self.writer = writer
        self.by_name: dict[str, HostShard] = {}
        self.kv: HostShard | None = None
        self._lock = threading.RLock()
        self._opened = False  # every bound host shard is open under its current share
        self._settled = False  # on_host_pools_registered came: a pool registered from now on opens at once
        # Why nothing is served (a refusal or a failed open): the error's message, never the error, whose
        # traceback's frames hold their callers (the backend, the host pool): a reference cycle.
        self._failed: str | None = None

    # ------------------------------------------------------------------ registration
    def register(self, name: str, pool: Any, open_now: bool = False) -> HostShard:
        """Serve ``pool`` under ``name``, or raise ``UnservedPoolError`` (see the module docstring); with
        ``open_now`` (or once the pools are settled) the host shards are opened under their shares before it
        returns, and their errors propagate."""
        with self._lock:
            self._check_serving()
            open_now = (open_now and not self._fixed_regions()) or self._settled  # (late: every share changes)
            known = self.by_name.get(name)
            if known is not None:
                if known.pages.pool is pool:
                    return known  # the KV pool again, through v2: served by its host shard
                raise self._refuse(UnservedPoolError(
                    name, pool, f"another pool ({type(known.pages.pool).__name__}) is registered under that "
                                f"name and is the one served"))
            try:
                shard = HostShard.bind(name, HostPages.of(pool), self.storage_config, self.config, self.writer)
            except Exception as exc:
                raise self._refuse(UnservedPoolError(name, pool, f"its pages cannot be described: {exc!r}")) from exc
            self.by_name[name] = shard
            if name == KV:
                self.kv = shard
            self._opened = False
            if open_now:
                self._open_all()
            return shard

    def _fixed_regions(self) -> bool:
        """Whether a device is a raw block device (its regions are sized once, at their first claim)."""
        return any(is_block_like(path) for path in self.config.devices)

    def _refuse(self, error: UnservedPoolError) -> UnservedPoolError:
        log.error("kvtier: %s; this backend releases what it opened and serves nothing", error)
        self._give_up(error)
        return error

    # ------------------------------------------------------------------ opening
    def open_all(self) -> None:
        """Every pool is registered: open each host shard not open yet under its share, reopen those whose
        share changed; a pool registered later opens at once. Idempotent."""
        with self._lock:
            self._check_serving()
            self._settled = True
            self._open_all()

    def ready(self) -> None:
        """Before a call that needs the stores: open them if nobody did (errors propagate)."""
        if not self._opened:
            with self._lock:
                self._check_serving()
                if not self._opened and self.by_name:
                    self._open_all()

    def _check_serving(self) -> None:
        if self._failed is not None:
            raise KVTierError(f"not serving: {self._failed}")

    def _open_all(self) -> None:
        """Open or reopen every host shard under its share; on any failure release them all and re-raise."""
        shards = list(self.by_name.values())
        try:
            limit, configs = self._shares(shards)
            for shard, config in zip(shards, configs):
                if not shard.opened:
                    shard.open(config)
                elif config != shard.config:
                    shard.reopen(config)
                else:
                    continue
                log.info("kvtier: pool %s -> %s (%s, %d-byte pages, %s, capacity %s bytes)", shard.name,
                         shard.namespace.dirname(), shard.namespace.describe(), shard.pages.page_bytes,
                         shard.pages.access.value, config.capacity_bytes if self.writer else "as written")
            if self.writer:
                _check_limit(shards, limit)
        except BaseException as exc:
            self._give_up(exc)
            raise
        self._opened = True

    def _shares(self, shards: list[HostShard]) -> tuple[int, list[StoreConfig]]:
        """The backend's limit and each host shard's config under its share (a reader's: as configured)."""
        if not self.writer:
            return 0, [self.config] * len(shards)
        limit = backend_limit(self.config, [s.namespace for s in shards])
        shares = split(limit, [(s.name, s.namespace) for s in shards], len(self.config.devices))
        return limit, [dataclasses.replace(self.config, capacity_bytes=share) for share in shares]

    def _give_up(self, error: BaseException) -> None:
        """``error`` ends this backend's service: release every host shard (their failures become its notes)."""
        shards, self.by_name, self.kv, self._opened = list(self.by_name.values()), {}, None, False
        self._failed = str(error)
        abandon(error, "the backend's host shards", [(f"pool {s.name}", s.close) for s in shards])

    # ------------------------------------------------------------------ closing
    def close(self) -> list[Failure]:
        """Close every host shard, each whatever the others raise; the ``(step, error)`` of each that failed."""
        with self._lock:
            shards, self.by_name, self.kv, self._opened = list(self.by_name.values()), {}, None, False
        return run_steps((f"pool {s.name}", s.close) for s in shards)


def _check_limit(shards: list[HostShard], limit: int) -> None:
    """``KVTierError`` when the opened stores' capacities add up to more than ``limit``."""
    held = {s.name: s.store.stats().capacity_bytes for s in shards if s.store is not None}
    if sum(held.values()) > limit:
        each = ", ".join(f"{name} {n}" for name, n in held.items())
        raise KVTierError(f"capacity_bytes: the host shards' capacities ({each} bytes) add up to more than the "
                          f"backend's limit of {limit} bytes; a raw block device's region keeps the size it "
                          f"was first claimed with: zero the device's region table to claim it anew")
