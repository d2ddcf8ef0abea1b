"""One byte limit per backend, split over its host shards.

A backend (one rank's ``KVTierStorage``) stores the KV pool and any side pools SGLang registers (SWA, Mamba,
draft KV, ...), each in a host shard of its own. ``capacity_bytes``, or the free-space default, is the limit of
the *backend*: its host shards share it, never each getting all of it.

The limit (``backend_limit``): ``capacity_bytes`` when set; otherwise, per device, 90 % of (its free space +
the segment files this backend's shards already hold there) on a directory, the device's size less its region
table on a raw block device, or this host's share of a pool formatted for several hosts
(``sgl-kvtier pool-format``); each divided by the number of rank shards sharing the devices (on a pool: then
less every shard's journal areas, 95 % of the rest); then the smallest device's budget times the number of devices
(pages are striped). The store's own rule for one shard, taken once for all of a backend's shards.

The split (``split``): every host shard gets room for the same number of pages (a prefix every pool must
restore fits in all of them alike), so shares are proportional to the flash size of one page (its slot: page
and trailer, 4 KiB-aligned). Each share is whole slots on every device, the shares never add up to more than
the limit, and a limit too small for one page of every pool on every device is refused, naming the pools.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import ConfigError, DeviceError
from sgl_kvtier.keys import Namespace
from sgl_kvtier.media.shared_raw.regions import journal_bytes_for
from sgl_kvtier.media.shared_raw.superblock import superblock_of
from sgl_kvtier.store.devices import is_block_like
from sgl_kvtier.store.format import BLOCK_HEADER_BYTES, JOURNAL_AREAS, slot_bytes_for

FREE_SPACE_SHARE = 0.9  # of a directory device's free space, as the store's own default
POOL_SHARE = 0.95  # of a host's share of a pool device, after the journal areas (the rest: checkpoint areas)


def slot_bytes(namespace: Namespace) -> int:
    """The flash bytes one page of ``namespace`` takes (its slot: the page and its trailer, format 2)."""
    return slot_bytes_for(namespace.page_bytes)


def backend_limit(config: StoreConfig, namespaces: Sequence[Namespace]) -> int:
    """The byte limit of a backend whose shards are ``namespaces`` (see the module docstring)."""
    if config.capacity_bytes is not None:
        return config.capacity_bytes
    shards = max(1, namespaces[0].shard_count) if namespaces else 1
    per_device = [_budget(config, i, path, namespaces, shards) for i, path in enumerate(config.devices)]
    return min(per_device) * len(config.devices)


def _budget(config: StoreConfig, index: int, path: str, namespaces: Sequence[Namespace], shards: int) -> int:
    """One rank's budget on device ``path``. On a pool device: its part of this host's share, less every
    shard's journal areas (kept on the first device only, but counted on each: the smallest decides)."""
    sb = superblock_of(path)
    if sb is None:
        return _device_budget(index, path, namespaces) // shards
    parts = max((len(ns.part_sizes()) for ns in namespaces), default=1)
    journals = JOURNAL_AREAS * journal_bytes_for(config.checkpoint_interval, parts) * max(1, len(namespaces))
    return max(0, int((sb.share_bytes // shards - journals) * POOL_SHARE))


def _device_budget(index: int, path: str, namespaces: Sequence[Namespace]) -> int:
    """A block device's size less its region table, or 90 % of a directory's free space + our segments."""
    if is_block_like(path):  # raises DeviceError for a missing path
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise DeviceError(f"devices[{index}]: {path}: cannot open: {exc.strerror}") from None
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
        return max(0, size - BLOCK_HEADER_BYTES)
    try:
        fs = os.statvfs(path)
    except OSError as exc:
        raise DeviceError(f"devices[{index}]: {path}: {exc.strerror}") from None
    if fs.f_blocks == 0:
        raise DeviceError(f"devices[{index}]: {path}: the filesystem reports no size; set capacity_bytes")
    used = sum(seg.stat().st_size for ns in namespaces for seg in (Path(path) / ns.dirname()).glob("w-*/seg-*.dat"))
    return int((fs.f_bavail * fs.f_frsize + used) * FREE_SPACE_SHARE)


def split(limit: int, pools: Sequence[tuple[str, Namespace]], devices: int) -> list[int]:
    """Each pool's ``capacity_bytes`` out of ``limit``: the same page count for every pool, whole slots on
    each of ``devices`` devices; the sum is at most ``limit``. ``ConfigError`` (``capacity_bytes``) when
    the limit cannot hold one page of every pool on every device."""
    slots = [slot_bytes(ns) for _, ns in pools]
    pages_per_device = limit // (devices * sum(slots)) if slots else 0
    if pages_per_device < 1:
        need = ", ".join(f"{name} ({s} bytes)" for (name, _), s in zip(pools, slots))
        raise ConfigError("capacity_bytes", f"{limit} bytes cannot hold one page of each pool on each of the "
                                            f"{devices} device(s): {need}")
    return [pages_per_device * devices * s for s in slots]
