"""Regions of a shared raw pool: where one writer's areas and slots lie, and finding them by path.

A region (``store.format``, "Shared raw pool") is one writer's (a process x a namespace shard) part of its
host's share on one device: on the pool's first device its meta areas (header, LEASE, CONFIG, checkpoint
A/B, journal areas) then its slots; on the others its slots only. Sizes (``plan_region``): a checkpoint area
holds a checkpoint of every slot (``checkpoint_bytes_for``), a journal area twice the records between
checkpoints (``journal_bytes_for``). Regions are made by ``sharing.shared_raw_claim`` and never move or go,
so a region found is remembered per (device, pool id, namespace, wid).

Paths: a writer of a shared raw pool is named as a writer directory would be, ``<dev>/ns-<digest>/w-<wid>``
(``<dev>``: the pool's first device). That is no directory, so a plain file operation on it fails with
ENOTDIR, and on that error ``sharing.writers`` (``writer_dirs``, ``writer_alive``), ``sharing.lease.read_lease``,
``store.layout.load_config`` and ``sharing.peers`` turn to ``region_of`` and friends here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import DeviceError, KVTierError
from sgl_kvtier.keys import Namespace
from sgl_kvtier.media.shared_raw.superblock import (
    BLOCK,
    REGION_ALIGN,
    Superblock,
    block_like,
    open_direct,
    range_locked,
    read_at,
    read_superblock,
    read_table,
    up,
)
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import journal_write as jw


@dataclass(frozen=True)
class Region:
    """One writer's region on one device (its table entry; offsets absolute)."""

    host: int
    ns: bytes
    wid: str
    offset: int
    length: int
    data_at: int
    slots: int
    checkpoint_bytes: int
    journal_bytes: int
    journals: int

    @classmethod
    def of(cls, host: int, e: dict[str, Any]) -> Region:
        return cls(host, bytes(e["ns"]), str(e["wid"]), int(e["offset"]), int(e["length"]), int(e["data_at"]),
                   int(e["slots"]), int(e["checkpoint_bytes"]), int(e["journal_bytes"]), int(e["journals"]))

    def entry(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "host"}

    def at(self, rel: int) -> int:
        return self.offset + rel

    def checkpoint_at(self, i: int) -> int:
        return self.offset + fmt.REGION_CHECKPOINT_AT + i * self.checkpoint_bytes

    def journal_at(self, i: int) -> int:
        return self.checkpoint_at(2) + i * self.journal_bytes


def plan_region(host: int, ns: bytes, wid: str, start: int, slot_bytes: int, slots: int, checkpoint_bytes: int,
                journal_bytes: int, journals: int) -> Region:
    """A region at ``start`` (aligned) holding these areas, then ``slots`` slots."""
    meta = up(fmt.REGION_CHECKPOINT_AT + 2 * checkpoint_bytes + journals * journal_bytes, REGION_ALIGN)
    start = up(start, REGION_ALIGN)
    return Region(host, ns, wid, start, up(meta + slots * slot_bytes, REGION_ALIGN), start + meta, slots,
                  checkpoint_bytes, journal_bytes, journals)


def checkpoint_bytes_for(slots: int, parts: int) -> int:
    """A checkpoint area with room for ``slots`` pages of ``parts`` parts (its header block included)."""
    return up(2 * BLOCK + 512 + slots * (56 + 8 * parts))


def journal_bytes_for(checkpoint_interval: int, parts: int) -> int:
    """A journal area: twice the records between checkpoints (one is due at half full), 256 KiB at least."""
    return up(max(256 << 10, 2 * checkpoint_interval * jw.record_estimate(parts)), REGION_ALIGN)


def region_header(namespace: Namespace, slot_bytes: int, index: int, count: int, store_id: str) -> dict[str, Any]:
    """The header a region of ``namespace`` on device ``index`` of ``count`` carries (a device header's
    fields; ``store_id``: the pool id)."""
    return {"namespace": namespace.to_mapping(), "slot_bytes": slot_bytes, "parts": namespace.part_sizes(),
            "device_index": index, "device_count": count, "store_id": store_id}


def regions_of(fd: int, sb: Superblock, ns: bytes | None = None) -> list[Region]:
    """Every region of every host slot (of namespace ``ns`` only, unless None), host by host."""
    return [Region.of(h, e) for h in range(sb.hosts) for e in read_table(fd, sb, h)[1] if ns is None or e["ns"] == ns]


def in_share(config: StoreConfig, lease: dict[str, Any]) -> bool:
    """Whether a writer's lease counts in this writer's quota: always, but on a shared raw pool, where only
    the writers of its own host slot (its share) do."""
    return config.host_index is None or lease.get("host_index") == config.host_index


_regions: dict[tuple[str, str, bytes, str], Region] = {}


def pool_namespaces(dev: str) -> list[tuple[Path, dict[str, Any]]] | None:
    """Every namespace with a region on pool device ``dev``: (its path ``<dev>/ns-<digest>``, the header of
    its first region), in table order; None when ``dev`` is no pool."""
    with _pool(dev) as opened:
        if opened is None:
            return None
        fd, sb = opened
        out: dict[bytes, dict[str, Any]] = {}
        for region in regions_of(fd, sb):
            if region.ns not in out:
                where = f"{dev} region of writer {region.wid}"
                out[region.ns] = fmt.unpack_header(fmt.HEADER_MAGIC, read_at(fd, region.offset, BLOCK), where)
        return [(Path(dev) / ("ns-" + ns.hex()), header) for ns, header in out.items()]


@contextmanager
def _pool(dev: str) -> Iterator[tuple[int, Superblock] | None]:
    """``(fd, superblock)`` of pool device ``dev`` opened read-only with O_DIRECT (closed after), or None
    when it cannot be opened or holds no pool."""
    try:
        fd = open_direct(dev, False)
    except DeviceError:
        yield None
        return
    try:
        sb = read_superblock(fd, dev)
        yield None if sb is None else (fd, sb)
    finally:
        os.close(fd)


def region_of(path: Path) -> tuple[str, Superblock, Region, str] | None:
    """For ``<dev>/ns-<digest>/w-<wid>[/<name>]`` on a pool device: (device, superblock, the region, name or
    ""); None for any other path, or where there is no such region."""
    parsed = _parse(path)
    if parsed is None or parsed[2] is None:
        return None
    dev, ns, wid, name = parsed[0], parsed[1], parsed[2], parsed[3]
    try:
        with _pool(dev) as opened:
            if opened is None:
                return None
            fd, sb = opened
            key = (dev, sb.pool_id, ns, wid)
            region = _regions.get(key)
            if region is None:
                region = next((r for r in regions_of(fd, sb, ns) if r.wid == wid), None)
                if region is None:
                    return None
                _regions[key] = region
            return dev, sb, region, name
    except (KVTierError, OSError):
        return None  # unreadable or damaged: no region here now (the open of a writer reports why)


def _parse(path: Path) -> tuple[str, bytes, str | None, str] | None:
    parts = Path(path).parts
    for i in range(len(parts) - 1, max(0, len(parts) - 4), -1):
        if parts[i].startswith("ns-") and block_like(str(Path(*parts[:i]))):
            try:
                ns = bytes.fromhex(parts[i][3:])
            except ValueError:
                return None
            rest = parts[i + 1:]
            wid = rest[0][2:] if rest and rest[0].startswith("w-") else None
            return str(Path(*parts[:i])), ns, wid, rest[1] if len(rest) > 1 else ""
    return None


def pool_writers(ns_meta: Path) -> list[str] | None:
    """The wids of every region of namespace ``ns_meta`` (``<dev>/ns-<digest>``) on a pool device, every host
    slot's; None when ``ns_meta`` is not a pool's."""
    parsed = _parse(ns_meta)
    if parsed is None:
        return None
    dev, ns = parsed[0], parsed[1]
    with _pool(dev) as opened:
        return None if opened is None else sorted(r.wid for r in regions_of(opened[0], opened[1], ns))


def region_read(path: Path, rel: int, size: int) -> bytes | None:
    """``size`` bytes at ``rel`` in the region of writer path ``path`` (its LEASE: ``REGION_LEASE_AT``);
    None when ``path`` names no region."""
    found = region_of(path)
    if found is None:
        return None
    fd = open_direct(found[0], False)
    try:
        return read_at(fd, found[2].at(rel), size)
    finally:
        os.close(fd)


def region_alive(path: Path) -> bool | None:
    """Whether a process of THIS host holds the writer lock of region ``path`` (None: no such region)."""
    found = region_of(path)
    if found is None:
        return None
    fd = open_direct(found[0], False)
    try:
        return range_locked(fd, found[2].offset, 1)
    finally:
        os.close(fd)


def region_identity(path: Path) -> tuple[int, int] | None:
    """(host slot, offset) of region ``path``: what stands for a directory's (st_dev, st_ino)."""
    found = region_of(path)
    return None if found is None else (found[2].host, found[2].offset)
