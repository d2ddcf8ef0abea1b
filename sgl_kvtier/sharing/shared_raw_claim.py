"""Claiming a writer's region of a shared raw pool (``sharing = "cluster"`` with ``host_index``), and the host
lease that says which machine holds a host slot (the site's claim there, ``sharing.sites.SharedRawSite``).

``claim``:
  1. The devices are checked as one pool (``media.shared_raw.superblock.open_pool``).
  2. The host slot: a host lease of another boot is watched for up to WATCH_BEATS of its heartbeats; if it
     advances another machine uses this ``host_index`` (``HostIndexInUseError``), else this one takes the
     slot over. An exact claim (``wid``: a reclaim or ``fsck --repair``) skips the watch.
  3. The region, under the host table's lock (an OFD write lock on its range of the first device): the lowest
     ``k`` whose region is in the table with its writer lock free (a restart gets its own back, warm), else
     a new region carved after the host's last one (its areas' first blocks and first slot zeroed, header
     written and synced, and only then the table naming it). A wid in another host slot's table is
     ``DuplicateHostError``. Every other device gets a region of that wid too (slots only).
  4. The writer lock: an OFD write lock on the region's first byte, on its own descriptor, held until
     ``WriterClaim.release``.
Each writer's lease beat also beats its host lease (``HostLease.beat``); a beat finding the slot taken over
writes nothing and ``taken_over`` says why: the writer is fenced (``sharing.fencing``). Until the old
machine's next beat, a writer only paused may still write into its region: misses, never wrong bytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import DeviceError, StoreLockedError
from sgl_kvtier.keys import Namespace
from sgl_kvtier.media.shared_raw.regions import (
    Region,
    checkpoint_bytes_for,
    journal_bytes_for,
    plan_region,
    region_header,
)
from sgl_kvtier.media.shared_raw.superblock import (
    BLOCK,
    Superblock,
    lock_range,
    open_direct,
    open_pool,
    read_host_lease,
    read_table,
    table_at,
    unlock_range,
    up,
    write_at,
    write_host_lease,
    write_table,
)
from sgl_kvtier.sharing.writers import (
    MAX_WATCHED_BEAT_S,
    MAX_WRITERS_PER_HOST,
    WATCH_BEATS,
    DuplicateHostError,
    WriterClaim,
    boot_id,
    host_id,
    machine_id,
)
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.format import writer_dirname

_TABLE_SPAN = 2 * fmt.HOST_TABLE_BYTES


class HostIndexInUseError(DuplicateHostError):
    """Another machine is beating the host lease of this ``host_index``."""


@dataclass(frozen=True)
class HostWatch:
    """How a claim watches a host lease of another boot: ``clock`` and ``sleep`` (tests inject both)."""

    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


DEFAULT_WATCH = HostWatch()


class HostLease:
    """Host slot ``host``'s lease on pool device ``dev``, beaten for this machine (``identity``: host_id,
    machine_id, boot_id, pid, host_index, heartbeat_s). Its descriptor is its own (O_DIRECT)."""

    def __init__(self, dev: str, sb: Superblock, host: int, identity: dict[str, Any]):
        self.sb, self.host, self.identity = sb, host, dict(identity)
        self.fd = open_direct(dev, True)

    def read(self) -> dict[str, Any] | None:
        return read_host_lease(self.fd, self.sb, self.host)

    def beat(self, take: bool = False) -> bool:
        """Advance the host lease for this machine; False (nothing written) when another boot holds the
        slot now, unless ``take``."""
        at = self.sb.slot_at(self.host)
        lock_range(self.fd, at, 2 * BLOCK, wait=True)
        try:
            now = self.read()
            if now is not None and not take and now.get("boot_id") != self.identity["boot_id"]:
                return False
            counter = 0 if now is None else int(now.get("counter", -1)) + 1
            write_host_lease(self.fd, self.sb, self.host, {**self.identity, "counter": counter})
            return True
        finally:
            unlock_range(self.fd, at, 2 * BLOCK)

    def taken_over(self) -> str | None:
        """Why this machine no longer holds the slot (another boot's lease there), or None."""
        now = self.read()
        if now is None or now.get("boot_id") == self.identity["boot_id"]:
            return None
        return f"host_index {self.host} was taken over by host {now.get('host_id')} (boot {now.get('boot_id')})"

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def host_identity(config: StoreConfig) -> dict[str, Any]:
    """What this machine's host lease says."""
    return {"host_id": host_id(config), "machine_id": machine_id(), "boot_id": boot_id(), "pid": os.getpid(),
            "host_index": config.host_index, "heartbeat_s": config.heartbeat_s}


def claim(config: StoreConfig, namespace: Namespace, wid: str | None = None,
          watch: HostWatch | None = None) -> WriterClaim:
    """Claim a region of ``namespace`` for this process (see the module docstring); with ``wid``, that
    existing region of this host only. Raises ConfigError (not one pool, host_index), HostIndexInUseError,
    DuplicateHostError, StoreLockedError (``wid`` held, or every region of this host held), DeviceError
    (the share is full, the table is full, a device cannot be opened)."""
    sbs = open_pool(config)
    lease = HostLease(config.devices[0], sbs[0], int(config.host_index or 0), host_identity(config))
    try:
        if wid is None:
            _take_slot(lease, config, watch or DEFAULT_WATCH)
        return _claim_region(config, namespace, sbs, host_id(config), wid)
    finally:
        lease.close()


def _take_slot(lease: HostLease, config: StoreConfig, watch: HostWatch) -> None:
    """Refuse a host slot another machine beats (module docstring, step 2); else take it."""
    seen = lease.read()
    other = None if seen is None else seen.get("boot_id")
    if seen is not None and other != lease.identity["boot_id"]:
        beat_s = min(float(seen.get("heartbeat_s") or config.heartbeat_s), MAX_WATCHED_BEAT_S)
        mark = (seen.get("counter"), other, seen.get("pid"))
        deadline = watch.clock() + WATCH_BEATS * beat_s
        while True:
            left = deadline - watch.clock()
            if left > 0:
                watch.sleep(min(left, beat_s / 4))
            now = lease.read()
            if now is not None and (now.get("counter"), now.get("boot_id"), now.get("pid")) != mark:
                raise HostIndexInUseError(
                    f"host_index {lease.host} is in use by host {now.get('host_id')} (boot {now.get('boot_id')}, "
                    f"this one's is {lease.identity['boot_id']}) on {config.devices[0]}: give each host its "
                    "own host_index")
            if left <= 0:
                break
    lease.beat(take=True)


def _claim_region(config: StoreConfig, namespace: Namespace, sbs: list[Superblock], host: str,
                  wid: str | None) -> WriterClaim:
    h, dev0, sb0 = int(config.host_index or 0), config.devices[0], sbs[0]
    fd = open_direct(dev0, True)
    try:
        lock_range(fd, table_at(sb0, h), _TABLE_SPAN, wait=True)
        try:
            region, lock_fd = _lowest_free(config, namespace, sb0, fd, host, wid)
        finally:
            unlock_range(fd, table_at(sb0, h), _TABLE_SPAN)
    finally:
        os.close(fd)
    try:
        for i in range(1, len(sbs)):
            _ensure_region(config, namespace, sbs[i], i, region.wid, data_only=True)
    except BaseException:
        os.close(lock_fd)
        raise
    k = int(region.wid.rpartition("-")[2])
    return WriterClaim(region.wid, host, k, Path(dev0) / namespace.dirname() / writer_dirname(region.wid), lock_fd)


def _lowest_free(config: StoreConfig, namespace: Namespace, sb: Superblock, fd: int, host: str,
                 wid: str | None) -> tuple[Region, int]:
    """Under the table lock: the lowest free region of this host (made where missing) and its locked fd."""
    h, ns = int(config.host_index or 0), namespace.digest()
    if wid is not None and wid.rpartition("-")[0] != host:
        raise DeviceError(f"{config.devices[0]}: {wid} is no writer of host {host} to claim")
    for w in [wid] if wid is not None else (f"{host}-{k}" for k in range(MAX_WRITERS_PER_HOST)):
        region = next((Region.of(h, e) for e in read_table(fd, sb, h)[1] if e["ns"] == ns and e["wid"] == w), None)
        if region is None:
            if wid is not None:
                raise DeviceError(f"{config.devices[0]}: host_index {h} has no region of writer {wid} to claim")
            region = _ensure_region(config, namespace, sb, 0, w, data_only=False, fd=fd)
        lock_fd = open_direct(config.devices[0], True)
        if lock_range(lock_fd, region.offset, 1, wait=False):
            return region, lock_fd
        os.close(lock_fd)
        if wid is not None:
            raise StoreLockedError(f"{config.devices[0]}: writer {wid} of host_index {h} is open for writing")
    raise StoreLockedError(f"{config.devices[0]}: all {MAX_WRITERS_PER_HOST} regions of host {host} are held")


def _ensure_region(config: StoreConfig, namespace: Namespace, sb: Superblock, index: int, wid: str,
                   data_only: bool, fd: int | None = None) -> Region:
    """Writer ``wid``'s region on device ``index`` (made if missing; ``fd``: the device, its table lock held
    by the caller; else taken here)."""
    own = fd is None
    fd = open_direct(sb.path, True) if fd is None else fd
    h, ns = int(config.host_index or 0), namespace.digest()
    try:
        if own:
            lock_range(fd, table_at(sb, h), _TABLE_SPAN, wait=True)
        gen, entries = read_table(fd, sb, h)
        found = next((Region.of(h, e) for e in entries if e["ns"] == ns and e["wid"] == wid), None)
        if found is not None:
            return found
        if index == 0:
            for other in range(sb.hosts):
                if other != h and any(e["ns"] == ns and e["wid"] == wid for e in read_table(fd, sb, other)[1]):
                    raise DuplicateHostError(
                        f"{sb.path}: writer {wid} of this namespace is host_index {other}'s: two hosts use host_id "
                        f"{wid.rpartition('-')[0]}; give each host its own host_id")
        region = _plan(config, namespace, sb, h, wid, entries, data_only)
        _initialise(fd, region, namespace, sb, index, len(config.devices))
        write_table(fd, sb, h, gen + 1, [*entries, region.entry()])  # crash rule: after the region is ready
        return region
    finally:
        if own:
            os.close(fd)  # drops the table lock too


def _plan(config: StoreConfig, namespace: Namespace, sb: Superblock, h: int, wid: str,
          entries: list[dict[str, Any]], data_only: bool) -> Region:
    parts = len(namespace.part_sizes())
    slot_bytes = fmt.slot_bytes_for(namespace.page_bytes, parts=parts)
    lo, hi = sb.share(h)
    start = max([lo, *(int(e["offset"]) + int(e["length"]) for e in entries)])
    journal = 0 if data_only else journal_bytes_for(config.checkpoint_interval, parts)
    journals = 0 if data_only else fmt.JOURNAL_AREAS

    def ckpt(n: int) -> int:
        return 0 if data_only else checkpoint_bytes_for(n, parts)
    if config.capacity_bytes is not None:
        slots = up(-(-config.capacity_bytes // len(config.devices)), slot_bytes) // slot_bytes
    else:  # no limit: this host's share split over the model's shards, as a raw device's whole size is
        total = (hi - lo) // namespace.shard_count
        slots = max(1, (total - fmt.REGION_CHECKPOINT_AT - journals * journal) // (slot_bytes + 2 * (56 + 8 * parts)))
        while slots > 1 and plan_region(h, b"", wid, lo, slot_bytes, slots, ckpt(slots), journal,
                                        journals).length > total:
            slots -= max(1, slots // 64)
    region = plan_region(h, namespace.digest(), wid, start, slot_bytes, slots, ckpt(slots), journal, journals)
    if region.offset + region.length > hi:
        raise DeviceError(f"{sb.path}: host_index {h}'s share has {max(0, hi - region.offset)} bytes left, writer "
                          f"{wid} needs {region.length} ({slots} slots of {slot_bytes} bytes and its journals)")
    return region


def _initialise(fd: int, region: Region, namespace: Namespace, sb: Superblock, index: int, count: int) -> None:
    """Zero the first block of every area of a new region and its first slot, write its header, sync."""
    zero = bytes(BLOCK)
    firsts = [region.at(fmt.REGION_LEASE_AT), region.at(fmt.REGION_LEASE_AT) + BLOCK, region.at(fmt.REGION_CONFIG_AT)]
    if region.checkpoint_bytes:
        firsts += [region.checkpoint_at(0), region.checkpoint_at(1)]
    firsts += [region.journal_at(i) for i in range(region.journals)]
    for at in firsts:
        write_at(fd, at, zero, sync=False)
    slot_bytes = fmt.slot_bytes_for(namespace.page_bytes, parts=len(namespace.part_sizes()))
    write_at(fd, region.data_at, bytes(slot_bytes), sync=False)
    header = region_header(namespace, slot_bytes, index, count, sb.pool_id)
    write_at(fd, region.at(fmt.REGION_HEADER_AT), fmt.pack_header(fmt.HEADER_MAGIC, header))
