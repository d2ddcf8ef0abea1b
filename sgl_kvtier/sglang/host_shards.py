"""A backend's pool tiers: every pool SGLang registers served or refused, one capacity over them all.

Registration (``register``): SGLang hands the KV pool to ``register_mem_pool_host`` and then every pool of
its ``HostPoolGroup`` to ``register_mem_host_pool_v2``, the KV pool again among them (as ``"kv"``). A pool
is *served* (bound to a tier of its own, ``"kv"`` being the KV tier) or *refused* with
``UnservedPoolError`` naming it: a second, different pool under a name already registered (``"kv"``
included), or a pool whose pages cannot be described (``HostPages.of``). Nothing is ignored. A refusal
fails the attach it belongs to: the backend then releases whatever it had opened and serves nothing.

Opening: the KV tier opens at once when ``register_mem_pool_host`` binds it, inside SGLang's guarded
attach (a failed open, another writer's lock included, is rolled back by SGLang), provisionally with
the whole limit; not on raw block devices, whose regions keep the size of their first claim, so there
the KV shard waits for the final split like the others. Once all pools are known (``open_all``, from ``on_host_pools_registered``; or, for a
caller that never says so, the first call that needs a store) every tier is opened under its share of
the backend's one byte limit (``capacity``): the KV tier is reopened under its smaller share when there
are side pools. A pool registered after that (SGLang adds draft-KV sidecars late) changes every share
again: the open writer tiers are reopened under theirs, the new one opened. The tiers' capacities, as the opened
stores report them, are checked never to add up to more than the limit (a raw block device's region
keeps the size it was first claimed with, so an old, larger one is refused here, not silently kept).
An open that fails releases every tier and leaves the backend serving nothing; the error propagates
(at start-up: SGLang refuses to start with it).

Closing (``close``): every tier is closed whatever the others raise; the failures are returned, in
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
    """The tiers of one backend by pool name (``kv`` the KV tier), their capacity split, open and close."""

    def __init__(self, storage_config: Any, config: StoreConfig, writer: bool):
        self.storage_config = storage_config
        self.config = config
        self.writer = writer
        self.by_name: dict[str, HostShard] = {}
        self.kv: HostShard | None = None
        self._lock = threading.RLock()
        self._opened = False  # every bound tier is open under its current share
        self._settled = False  # on_host_pools_registered came: a pool registered from now on opens at once
        # Why nothing is served (a refusal or a failed open): the error's message, never the error, whose
        # traceback's frames hold their callers (the backend, the host pool): a reference cycle.
        self._failed: str | None = None

    # ------------------------------------------------------------------ registration
    def register(self, name: str, pool: Any, open_now: bool = False) -> HostShard:
        """Serve ``pool`` under ``name``, or raise ``UnservedPoolError`` (see the module docstring); with
        ``open_now`` (or once the pools are settled) the tiers are opened under their shares before it
        returns, and their errors propagate."""
        with self._lock:
            self._check_serving()
            open_now = (open_now and not self._fixed_regions()) or self._settled  # (late: every share changes)
            known = self.by_name.get(name)
            if known is not None:
                if known.pages.pool is pool:
                    return known  # the KV pool again, through v2: served by the KV tier
                raise self._refuse(UnservedPoolError(
                    name, pool, f"another pool ({type(known.pages.pool).__name__}) is registered under that "
                                f"name and is the one served"))
            try:
                tier = HostShard.bind(name, HostPages.of(pool), self.storage_config, self.config, self.writer)
            except Exception as exc:
                raise self._refuse(UnservedPoolError(name, pool, f"its pages cannot be described: {exc!r}")) from exc
            self.by_name[name] = tier
            if name == KV:
                self.kv = tier
            self._opened = False
            if open_now:
                self._open_all()
            return tier

    def _fixed_regions(self) -> bool:
        """Whether a device is a raw block device (its regions are sized once, at their first claim)."""
        return any(is_block_like(path) for path in self.config.devices)

    def _refuse(self, error: UnservedPoolError) -> UnservedPoolError:
        log.error("kvtier: %s; this backend releases what it opened and serves nothing", error)
        self._give_up(error)
        return error

    # ------------------------------------------------------------------ opening
    def open_all(self) -> None:
        """Every pool is registered: open each tier not open yet under its share, reopen those whose share
        changed; a pool registered later opens at once. Idempotent."""
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
        tiers = list(self.by_name.values())
        try:
            limit, configs = self._shares(tiers)
            for tier, config in zip(tiers, configs):
                if not tier.opened:
                    tier.open(config)
                elif config != tier.config:
                    tier.reopen(config)
                else:
                    continue
                log.info("kvtier: pool %s -> %s (%s, %d-byte pages, %s, capacity %s bytes)", tier.name,
                         tier.namespace.dirname(), tier.namespace.describe(), tier.pages.page_bytes,
                         tier.pages.access.value, config.capacity_bytes if self.writer else "as written")
            if self.writer:
                _check_limit(tiers, limit)
        except BaseException as exc:
            self._give_up(exc)
            raise
        self._opened = True

    def _shares(self, tiers: list[HostShard]) -> tuple[int, list[StoreConfig]]:
        """The backend's limit and each tier's config under its share (a reader's: as configured)."""
        if not self.writer:
            return 0, [self.config] * len(tiers)
        limit = backend_limit(self.config, [t.namespace for t in tiers])
        shares = split(limit, [(t.name, t.namespace) for t in tiers], len(self.config.devices))
        return limit, [dataclasses.replace(self.config, capacity_bytes=share) for share in shares]

    def _give_up(self, error: BaseException) -> None:
        """``error`` ends this backend's service: release every tier (their failures become its notes)."""
        tiers, self.by_name, self.kv, self._opened = list(self.by_name.values()), {}, None, False
        self._failed = str(error)
        abandon(error, "the backend's pool tiers", [(f"pool {t.name}", t.close) for t in tiers])

    # ------------------------------------------------------------------ closing
    def close(self) -> list[Failure]:
        """Close every tier, each whatever the others raise; the ``(step, error)`` of each that failed."""
        with self._lock:
            tiers, self.by_name, self.kv, self._opened = list(self.by_name.values()), {}, None, False
        return run_steps((f"pool {t.name}", t.close) for t in tiers)


def _check_limit(tiers: list[HostShard], limit: int) -> None:
    held = {t.name: t.store.stats().capacity_bytes for t in tiers if t.store is not None}
    if sum(held.values()) > limit:
        each = ", ".join(f"{name} {n}" for name, n in held.items())
        raise KVTierError(f"capacity_bytes: the pool tiers' capacities ({each} bytes) add up to more than the "
                          f"backend's limit of {limit} bytes; a raw block device's region keeps the size it "
                          f"was first claimed with: zero the device's region table to claim it anew")
