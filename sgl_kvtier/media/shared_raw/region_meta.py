"""A writer's meta directory kept in its region of a shared raw pool (areas on the device; bytes in
``store.format``, "Shared raw pool"), and the region's slots as an arena.

``RegionFiles`` is both sides of one writer's region on the pool's first device:
  * a ``FileView`` (``io.file_view``) mapping a writer directory's names onto the areas, so recovery and
    following (``store.journal.recover`` / ``follow_announced``, ``sharing.follower.read_lease``) work
    unchanged: ``LEASE``, ``CONFIG``, ``HEADER``, ``checkpoint.bin`` (the newest valid checkpoint area),
    ``journal-<g>.log`` (area ``g % journals`` if it holds generation ``g``, presented as a journal file: the
    JOURNAL_MAGIC header and its valid records resealed unseeded, offsets unchanged); ``listdir`` names those
    present. Every read is fresh from the device (O_DIRECT): nothing is cached.
  * opened writable, the writer's ``store.meta.WriterMeta`` (``open_journal``, ``may_rotate``, A/B
    ``write_checkpoint``, ``lease_blocks``, ``save_config``, ``check_present``); what its areas hold is loaded
    at open and kept in step by its own writes (one writer per region).

Rotation rule: generation ``g`` may take area ``g % journals`` only when the generation that area holds is
covered by the durable checkpoint (``may_rotate``); else ``open_journal`` refuses (``EBUSY``) and the writer
checkpoints in place first. Overwriting a covered generation loses nothing.

``AreaJournal``: appends stay in memory until ``sync``, which rewrites the area's blocks from the last partly
synced one to the end (O_DIRECT, then fdatasync; one sync at a time, appends never wait for its IO); synced
bytes are rewritten unchanged, so a torn rewrite never damages a synced record. An append that does not fit
is ``ENOSPC`` before anything changes (``nearly_full`` past half: a checkpoint is due). Records carry an xxh32
seeded by the generation, so an older generation's records beyond the tail never replay.

Checkpoints (A/B): the new one goes to the area not holding the newest valid one: its bytes, sync, then its
header (serial = newest + 1), sync. A torn header or body leaves the other one newest; the valid one with
the higher serial wins (both checksums checked).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import CorruptRecordError, DeviceError, StoreFormatError
from sgl_kvtier.keys import Namespace
from sgl_kvtier.media.shared_raw.regions import Region, region_header, regions_of
from sgl_kvtier.media.shared_raw.superblock import BLOCK, Superblock, open_direct, open_pool, read_at, write_at
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.devices import Arena, check_header
from sgl_kvtier.store.lifecycle import abandon

CHUNK = 1 << 20  # journal areas are read this much at a time, up to their last valid record
_HEAD = fmt.JOURNAL_FILE_HEADER_BYTES


class RegionFiles:
    """One writer's meta areas on the pool's first device ``dev`` (see the module docstring)."""

    def __init__(self, dev: str, sb: Superblock, region: Region, path: Path, writable: bool):
        self.dev, self.sb, self.region, self.path, self.writable = dev, sb, region, path, writable
        self.fd = open_direct(dev, writable)
        self._areas: list[int | None] = []  # writer: the generation each journal area holds
        self._checkpoints: list[tuple[int, int] | None] = [None, None]  # writer: (serial, generation) if valid
        if writable:
            self._areas = [self._area_generation(i) for i in range(region.journals)]
            self._checkpoints = [self._checkpoint_head(i, verify=True) for i in range(2)]

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    # ------------------------------------------------------------------ FileView
    def read(self, path: Path, offset: int = 0, limit: int | None = None) -> bytes:
        data = self._file(path.name, offset, limit)
        return data if path.name.startswith("journal-") else data[offset:None if limit is None else offset + limit]

    def size(self, path: Path) -> int:
        return len(self.read(path))

    def exists(self, path: Path) -> bool:
        return path == self.path or path.name in self.listdir(path.parent)

    def listdir(self, path: Path) -> list[str]:
        if path != self.path:
            return []
        names = ["HEADER", "LEASE", "CONFIG"]
        if any(self._checkpoint_head(i, verify=False) for i in range(2)):
            names.append("checkpoint.bin")
        gens = [self._area_generation(i) for i in range(self.region.journals)]
        return names + [f"journal-{g:08d}.log" for g in gens if g is not None]

    def _file(self, name: str, offset: int, limit: int | None) -> bytes:
        r = self.region
        if name == "LEASE":
            return read_at(self.fd, r.at(fmt.REGION_LEASE_AT), 2 * fmt.LEASE_BLOCK_BYTES)
        if name == "HEADER":
            return read_at(self.fd, r.at(fmt.REGION_HEADER_AT), BLOCK)
        if name == "CONFIG":
            return read_at(self.fd, r.at(fmt.REGION_CONFIG_AT), fmt.REGION_CONFIG_BYTES)
        if name == "checkpoint.bin":
            return self._checkpoint_bytes()
        if name.startswith("journal-") and name.endswith(".log") and r.journals:
            return self._journal(int(name[len("journal-"):-len(".log")]), offset, limit)
        raise FileNotFoundError(f"{self.path / name}: no such area")

    def _area_generation(self, i: int) -> int | None:
        return fmt.journal_area_generation(read_at(self.fd, self.region.journal_at(i), BLOCK))

    def _journal(self, gen: int, offset: int, limit: int | None) -> bytes:
        r, i = self.region, gen % self.region.journals
        if self._area_generation(i) != gen:
            raise FileNotFoundError(f"{self.path}/journal-{gen:08d}.log: its area holds another generation")
        end = r.journal_bytes if limit is None else min(r.journal_bytes, offset + limit)
        out = [fmt.journal_file_header(gen)[offset:]] if offset < _HEAD else []
        at, pending, seed = max(offset, _HEAD), b"", fmt.area_seed(gen)
        while at + len(pending) < end:
            chunk = read_at(self.fd, r.journal_at(i) + at + len(pending), min(CHUNK, end - at - len(pending)))
            if not chunk:
                break
            pending += chunk
            used, sealed, more = fmt.unseal_records(pending, 0, seed)
            out.append(sealed)
            at, pending = at + used, pending[used:]
            if not more:
                break
        return b"".join(out)

    def _checkpoint_head(self, i: int, verify: bool) -> tuple[int, int] | None:
        head = read_at(self.fd, self.region.checkpoint_at(i), BLOCK)
        try:
            f = fmt.unpack_header(fmt.CHECKPOINT_AREA_MAGIC, head, f"{self.path} checkpoint area {i}")
            serial, gen, length = int(f["serial"]), int(f["generation"]), int(f["length"])
        except (CorruptRecordError, KeyError, TypeError, ValueError):
            return None
        if verify and not fmt.checkpoint_intact(read_at(self.fd, self.region.checkpoint_at(i) + BLOCK, length)):
            return None
        return serial, gen

    def _checkpoint_bytes(self) -> bytes:
        heads = []
        for i in range(2):
            head = read_at(self.fd, self.region.checkpoint_at(i), BLOCK)
            try:
                heads.append((fmt.unpack_header(fmt.CHECKPOINT_AREA_MAGIC, head, "checkpoint area"), i))
            except CorruptRecordError:
                continue
        for f, i in sorted(heads, key=lambda h: -int(h[0].get("serial", -1))):
            data = read_at(self.fd, self.region.checkpoint_at(i) + BLOCK, int(f.get("length", 0)))
            if fmt.checkpoint_intact(data):
                return data
        raise FileNotFoundError(f"{self.path}/checkpoint.bin: no valid checkpoint area")

    # ------------------------------------------------------------------ WriterMeta
    @property
    def view(self) -> RegionFiles:
        return self

    def durable_generation(self) -> int:
        """The generation of the newest valid checkpoint (every one below it is covered); 0 without one."""
        newest = max((c for c in self._checkpoints if c is not None), default=None)
        return 0 if newest is None else newest[1]

    def may_rotate(self, generation: int) -> bool:
        held = self._areas[generation % len(self._areas)]
        return held is None or held < self.durable_generation()

    def open_journal(self, generation: int) -> AreaJournal:
        if not self.may_rotate(generation):
            i = generation % len(self._areas)
            raise OSError(errno.EBUSY, f"{self.path}: journal area {i} holds generation {self._areas[i]}, which "
                                       f"the checkpoint (generation {self.durable_generation()}) does not cover")
        journal = AreaJournal(self, generation)
        self._areas[generation % len(self._areas)] = generation
        return journal

    def write_checkpoint(self, blob: bytes, generation: int) -> None:
        valid = [(c, i) for i, c in enumerate(self._checkpoints) if c is not None]
        newest = max(valid, default=None)
        target = 0 if newest is None else 1 - newest[1]
        if BLOCK + len(blob) > self.region.checkpoint_bytes:
            raise OSError(errno.ENOSPC, f"{self.path}: a checkpoint of {len(blob)} bytes does not fit its area")
        at = self.region.checkpoint_at(target)
        serial = 0 if newest is None else newest[0][0] + 1
        self._checkpoints[target] = None  # crash rule: this area is not valid until its header is durable
        write_at(self.fd, at + BLOCK, blob)
        write_at(self.fd, at, fmt.pack_header(fmt.CHECKPOINT_AREA_MAGIC, {"serial": serial, "generation": generation,
                                                                          "length": len(blob)}))
        self._checkpoints[target] = (serial, generation)

    def lease_blocks(self, host_beat: Callable[[], bool] | None = None) -> AreaBlocks:
        return AreaBlocks(self, host_beat)

    def save_config(self, config: StoreConfig) -> None:
        data = fmt.pack_header(fmt.CONFIG_MAGIC, {"config": config.to_mapping()})
        if len(data) > fmt.REGION_CONFIG_BYTES:
            raise OSError(errno.ENOSPC, f"{self.path}: a config of {len(data)} bytes does not fit its area")
        write_at(self.fd, self.region.at(fmt.REGION_CONFIG_AT), data)

    def check_present(self, namespace: Namespace) -> None:
        """Refuse a region whose checkpoint and journals are all gone while its first slot holds a page of
        ``namespace`` (``store.layout.check_meta_present``'s rule for a region)."""
        if any(c is not None for c in self._checkpoints) or any(a is not None for a in self._areas):
            return
        slot = read_at(self.fd, self.region.data_at, fmt.slot_bytes_for(namespace.page_bytes,
                                                                         len(namespace.part_sizes())))
        trailer = fmt.unpack_trailer(slot[namespace.page_bytes:])
        if trailer is not None and trailer.ns_digest == namespace.digest():
            raise StoreFormatError(f"{self.path}: the journals and checkpoint of writer {self.region.wid} are gone "
                                   "but its region still holds pages (fsck --rebuild is not available for a shared "
                                   "raw pool yet): its pages are a cache; stop every writer of this host and "
                                   "zero its journal areas' first blocks to start it empty")


def read_config(data: bytes, what: str) -> dict[str, Any]:
    """The config mapping of a region's ``CONFIG`` bytes (CorruptRecordError when there is none)."""
    config: dict[str, Any] = fmt.unpack_header(fmt.CONFIG_MAGIC, data, what)["config"]
    return config


class AreaBlocks:
    """A region's LEASE blocks, for ``sharing.lease.Lease``: each write is synced, then ``host_beat`` runs (the
    host lease advances with every writer's beat, ``sharing.shared_raw_claim.HostLease.beat``)."""

    def __init__(self, files: RegionFiles, host_beat: Callable[[], bool] | None):
        self.files, self.host_beat = files, host_beat

    def write_block(self, index: int, data: bytes) -> None:
        write_at(self.files.fd, self.files.region.at(fmt.REGION_LEASE_AT) + index * fmt.LEASE_BLOCK_BYTES, data)
        if self.host_beat is not None:
            self.host_beat()

    def close(self) -> None:
        return None  # the descriptor is the region's


class AreaJournal:
    """One journal generation in its area (see the module docstring). Appends and syncs may come from
    several threads (the store serialises appends; syncs run outside its lock)."""

    def __init__(self, files: RegionFiles, generation: int):
        self.files, self.generation = files, generation
        self.path = files.path / f"journal-{generation:08d}.log"
        area = generation % files.region.journals
        self._at, self._bytes, self._seed = files.region.journal_at(area), files.region.journal_bytes, \
            fmt.area_seed(generation)
        self._lock, self._sync_lock = threading.Lock(), threading.Lock()
        head = fmt.journal_area_header(generation)
        write_at(files.fd, self._at, head)  # crash rule: the area names this generation before any record
        self.records = 0
        self.size = self.synced = len(head)
        self._tail_at, self._tail = 0, bytearray(head)  # the bytes from block ``_tail_at`` on, not all synced

    @property
    def nearly_full(self) -> bool:
        return self.size > self._bytes // 2

    def room(self) -> int | None:
        return self._bytes - self.size

    def append(self, records: list[bytes]) -> None:
        if not records:
            return
        data = b"".join(fmt.seal_record(r, self._seed) for r in records)
        with self._lock:
            if self.size + len(data) > self._bytes:
                raise OSError(errno.ENOSPC, f"{self.path}: journal area full ({self.size} of {self._bytes} bytes)")
            self._tail += data
            self.size += len(data)
            self.records += len(records)

    def sync(self) -> None:
        with self._sync_lock:
            with self._lock:
                size, at, data = self.size, self._tail_at, bytes(self._tail)
            if size > self.synced:
                write_at(self.files.fd, self._at + at, data)
                with self._lock:
                    whole = len(data) // BLOCK * BLOCK
                    del self._tail[:whole]
                    self._tail_at = at + whole
            self.synced = max(self.synced, size)

    def close(self) -> None:
        return None  # the descriptor is the region's


class PoolArena(Arena):
    """A region's slots on one pool device (an O_DIRECT descriptor of its own)."""

    def __init__(self, path: str, region: Region, slot_bytes: int, writable: bool):
        self.path, self.slot_bytes, self.capacity_slots, self.direct = path, slot_bytes, region.slots, True
        self.offset = region.data_at
        self.fd = open_direct(path, writable)

    def locate(self, local_slot: int) -> tuple[int, int]:
        return self.fd, self.offset + local_slot * self.slot_bytes

    def fds(self) -> list[int]:
        return [self.fd]

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def open_regions(config: StoreConfig, namespace: Namespace, path: Path, wid: str, slot_bytes: int,
                 writable: bool) -> tuple[list[Arena], RegionFiles, str]:
    """Writer ``wid``'s regions on every device of the pool: (arenas, its meta areas, the pool id). Raises
    DeviceError (no region of ``wid`` on a device), StoreFormatError (a header that disagrees),
    ConfigError (not one pool)."""
    sbs = open_pool(config)
    ns = namespace.digest()
    arenas: list[Arena] = []
    files: RegionFiles | None = None
    try:
        for i, (dev, sb) in enumerate(zip(config.devices, sbs)):
            fd = open_direct(dev, False)
            try:
                region = next((r for r in regions_of(fd, sb, ns) if r.wid == wid), None)
                if region is None:
                    raise DeviceError(f"devices[{i}]: {dev} has no region of writer {wid}")
                where = f"{dev} region of writer {wid}"
                try:
                    found = fmt.unpack_header(fmt.HEADER_MAGIC, read_at(fd, region.at(fmt.REGION_HEADER_AT), BLOCK), where)
                except CorruptRecordError as exc:
                    raise StoreFormatError(str(exc)) from None
            finally:
                os.close(fd)
            check_header(found, region_header(namespace, slot_bytes, i, len(sbs), sbs[0].pool_id), where)
            arenas.append(PoolArena(dev, region, slot_bytes, writable))
            if i == 0:
                files = RegionFiles(dev, sb, region, path, writable)
    except BaseException as exc:
        abandon(exc, str(path), [(f"device {a.path}", a.close) for a in arenas] + ([("region", files.close)] if files else []))
        raise
    assert files is not None
    return arenas, files, sbs[0].pool_id
