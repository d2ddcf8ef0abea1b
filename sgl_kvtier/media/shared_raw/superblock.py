"""A shared raw pool's devices: superblock, host slots (host lease, region table), locks and the IO rules.

A shared raw pool (``sharing = "cluster"`` with ``host_index``; bytes in ``store.format``, "Shared raw pool")
is one raw block device, or several striped, attached to several hosts and formatted once by
``sgl-kvtier pool-format`` (``format_pool``) for ``hosts`` hosts. Host ``h`` writes only host slot ``h`` and
share ``h`` of the data area, so no claim protocol spans hosts; within a host, processes claim regions in
the host's own table (``sharing.shared_raw_claim``).

IO: every descriptor of a pool device is O_DIRECT (``open_direct``; a device refusing it is a
``DeviceError``: Linux caches buffered block-device reads per host, so another host's writes would be
missed); every read and write moves whole ``POOL_BLOCK`` blocks through page-aligned ``mmap`` memory
(``read_at`` / ``write_at``), a write followed by ``fdatasync`` before anything relies on it.

Locks: OFD byte-range locks (``F_OFD_SETLK``) on the device node. They are host-local, so they order only
one host's processes (another host could contend only for its own slot), and belong to an open file
description, so closing another descriptor of the device never drops them (POSIX record locks would).
A table changes under a write lock on its range; an open writer holds a write lock on its region's first
byte (``region_alive`` asks ``F_OFD_GETLK``); a host lease is beaten under a lock on the lease range.

Formatting never overwrites anything: a device whose first or last MiB is not all zeros is refused, naming
the ``dd`` command that zeroes it; the host slots are zeroed first, the superblock written last.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import ConfigError, CorruptRecordError, DeviceError, StoreFormatError
from sgl_kvtier.store import format as fmt

BLOCK = fmt.POOL_BLOCK
MiB = 1 << 20
REGION_ALIGN = 64 << 10
_OFD_GETLK, _OFD_SETLK, _OFD_SETLKW = (getattr(fcntl, n, v) for n, v in
                                       (("F_OFD_GETLK", 36), ("F_OFD_SETLK", 37), ("F_OFD_SETLKW", 38)))


def up(n: int, align: int = BLOCK) -> int:
    return -(-n // align) * align


# ------------------------------------------------------------------------------------------------- IO
def open_direct(path: str, writable: bool) -> int:
    """A descriptor of pool device ``path`` with O_DIRECT (read-write or read-only)."""
    try:
        return os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise DeviceError(f"{path}: refuses O_DIRECT, which a shared raw pool needs for every read and "
                              "write (Linux caches block-device reads per host)") from None
        raise DeviceError(f"{path}: cannot open: {exc.strerror}") from None


def read_at(fd: int, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset`` (short at the device's end), read in aligned blocks with O_DIRECT."""
    start = offset // BLOCK * BLOCK
    span = up(offset + size) - start
    buf = mmap.mmap(-1, span)
    try:
        got = os.preadv(fd, [buf], start)
        return bytes(buf[offset - start:min(got, offset - start + size)])
    finally:
        buf.close()


def write_at(fd: int, offset: int, data: bytes, sync: bool = True) -> None:
    """Write ``data`` (zero-padded to whole blocks) at aligned ``offset`` with O_DIRECT, then fdatasync."""
    if offset % BLOCK:
        raise ValueError(f"unaligned pool write at {offset}")
    buf = mmap.mmap(-1, up(max(len(data), 1)))
    try:
        buf[:len(data)] = data
        if os.pwritev(fd, [buf], offset) != len(buf):
            raise OSError(errno.EIO, f"short write at {offset}")
    finally:
        buf.close()
    if sync:
        os.fdatasync(fd)


# ---------------------------------------------------------------------------------------------- locks
def _flock(kind: int, start: int, length: int) -> bytes:
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, start, length, 0)


def lock_range(fd: int, start: int, length: int, wait: bool) -> bool:
    """Take an OFD write lock on ``[start, start + length)``; False when another description holds one
    (only without ``wait``). ``fd`` must be open for writing."""
    try:
        fcntl.fcntl(fd, _OFD_SETLKW if wait else _OFD_SETLK, _flock(fcntl.F_WRLCK, start, length))
        return True
    except OSError as exc:
        if not wait and exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def unlock_range(fd: int, start: int, length: int) -> None:
    fcntl.fcntl(fd, _OFD_SETLK, _flock(fcntl.F_UNLCK, start, length))


def range_locked(fd: int, start: int, length: int) -> bool:
    """Whether another open file description of this host holds a write lock over the range."""
    out = fcntl.fcntl(fd, _OFD_GETLK, _flock(fcntl.F_WRLCK, start, length))
    return bool(struct.unpack_from("h", out)[0] != fcntl.F_UNLCK)


# ------------------------------------------------------------------------------------------ superblock
@dataclass(frozen=True)
class Superblock:
    """A pool device's geometry (``store.format``)."""

    path: str
    pool_id: str
    hosts: int
    device_index: int
    device_count: int
    device_bytes: int
    host_slots_at: int
    host_slot_bytes: int
    data_at: int
    share_bytes: int

    def slot_at(self, host: int) -> int:
        return self.host_slots_at + host * self.host_slot_bytes

    def share(self, host: int) -> tuple[int, int]:
        """Host ``host``'s part of the data area, ``[start, end)``."""
        start = self.data_at + host * self.share_bytes
        return start, start + self.share_bytes

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "path"}


def read_superblock(fd: int, path: str) -> Superblock | None:
    """The superblock of the device open as ``fd``; None when it holds none (no POOL_MAGIC). A damaged one
    is a StoreFormatError."""
    head = read_at(fd, 0, BLOCK)
    if not head.startswith(fmt.POOL_MAGIC):
        return None
    try:
        f = fmt.unpack_header(fmt.POOL_MAGIC, head, f"{path} superblock")
        return Superblock(path, str(f["pool_id"]), int(f["hosts"]), int(f["device_index"]), int(f["device_count"]),
                          int(f["device_bytes"]), int(f["host_slots_at"]), int(f["host_slot_bytes"]),
                          int(f["data_at"]), int(f["share_bytes"]))
    except (CorruptRecordError, KeyError, TypeError, ValueError) as exc:
        raise StoreFormatError(f"{path}: damaged pool superblock ({exc})") from None


def superblock_of(path: str) -> Superblock | None:
    """``read_superblock`` of ``path`` (None also where it is not a file or block device, or unreadable)."""
    if not block_like(path):
        return None
    try:
        fd = open_direct(path, False)
    except DeviceError:
        return None
    try:
        return read_superblock(fd, path)
    finally:
        os.close(fd)


def block_like(path: str) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISBLK(mode) or stat.S_ISREG(mode)


def _zero_refusal(path: str, what: str) -> DeviceError:
    return DeviceError(f"{path}: {what}; refusing to format it. If it is free, zero it first (its first and "
                       f"last MiB at least): blkdiscard -z {path}, or dd if=/dev/zero of={path} bs=1M "
                       "(to its end)")


def format_pool(paths: list[str], hosts: int, write: bool = True) -> list[Superblock]:
    """Format ``paths`` (striped in that order) as one pool of ``hosts`` host slots (see the module
    docstring); the superblocks (with ``write`` False: what would be written, nothing is). Raises
    DeviceError (not all zeros, too small, not openable) or ConfigError (``hosts``)."""
    if not 1 <= hosts <= 1024:
        raise ConfigError("hosts", f"must be in 1..1024, got {hosts}")
    pool_id, out = uuid.uuid4().hex, []
    fds = [open_direct(p, True) for p in paths]
    try:
        for i, (path, fd) in enumerate(zip(paths, fds)):
            size = os.lseek(fd, 0, os.SEEK_END)
            head, tail = read_at(fd, 0, MiB), read_at(fd, max(0, size - MiB), MiB)
            if head.startswith(fmt.POOL_MAGIC):
                raise _zero_refusal(path, "is a shared raw pool already")
            if head.startswith(fmt.REGION_MAGIC):
                raise _zero_refusal(path, "holds a single-host sgl-kvtier region table")
            if head.count(0) != len(head) or tail.count(0) != len(tail):
                raise _zero_refusal(path, "holds data (not all zeros)")
            data_at = up(fmt.HOST_SLOTS_AT + hosts * fmt.HOST_SLOT_BYTES, MiB)
            share = (size - data_at) // hosts // REGION_ALIGN * REGION_ALIGN
            if share < MiB:
                raise DeviceError(f"{path}: too small for {hosts} hosts: {size} bytes leave {max(share, 0)} per host")
            out.append(Superblock(path, pool_id, hosts, i, len(paths), size, fmt.HOST_SLOTS_AT,
                                  fmt.HOST_SLOT_BYTES, data_at, share))
        for sb, fd in zip(out, fds) if write else ():
            write_at(fd, sb.host_slots_at, bytes(hosts * sb.host_slot_bytes))  # crash rule: slots empty first
            write_at(fd, 0, fmt.pack_header(fmt.POOL_MAGIC, sb.fields()))
    finally:
        for fd in fds:
            os.close(fd)
    return out


def open_pool(config: StoreConfig) -> list[Superblock]:
    """Every device's superblock, checked as one pool that ``config.host_index`` fits (ConfigError naming
    the field: a device not pool-formatted, devices of other pools or out of order, a bad host_index)."""
    sbs: list[Superblock] = []
    for i, path in enumerate(config.devices):
        sb = superblock_of(path)
        if sb is None:
            raise ConfigError(f"devices[{i}]", f"{path} is not a shared raw pool: run `sgl-kvtier pool-format "
                                               f"{' '.join(config.devices)} --hosts H` once, from one host")
        if sb.device_index != i or sb.device_count != len(config.devices) or sb.pool_id != (sbs or [sb])[0].pool_id:
            raise ConfigError("devices", f"{path} is device {sb.device_index} of {sb.device_count} of pool "
                                         f"{sb.pool_id}, not device {i} of {len(config.devices)} of this pool "
                                         "(devices reordered, added, removed or of another pool?)")
        sbs.append(sb)
    h = config.host_index
    if h is None or not 0 <= h < sbs[0].hosts:
        raise ConfigError("host_index", f"{config.devices[0]} is a shared raw pool of {sbs[0].hosts} hosts: "
                                        f"set host_index to this host's slot, 0..{sbs[0].hosts - 1}, distinct "
                                        f"per host (got {h})")
    return sbs


def check_pool_open(config: StoreConfig) -> None:
    """The start-up refusals of a cluster config on raw devices (``sharing.cluster_fs.check.check_cluster_open``):
    a device not pool-formatted ("run sgl-kvtier pool-format"), a single-host region-table device, directories
    mixed in, a meta_dir (not needed), host_index missing or out of range. ConfigError naming the field."""
    for i, path in enumerate(config.devices):
        if not block_like(path):
            raise ConfigError(f"devices[{i}]", f"{path} is a directory, but devices[0] is a raw device: a shared "
                                               "raw pool is raw devices only")
        fd = open_direct(path, False)
        try:
            head = read_at(fd, 0, BLOCK)
        finally:
            os.close(fd)
        if head.startswith(fmt.REGION_MAGIC):
            raise ConfigError(f"devices[{i}]", f'{path} holds a single-host region table (sharing = "host" with '
                                               'a meta_dir); it cannot be shared by hosts: keep sharing = "host" '
                                               "there, or pool-format a blank namespace")
    open_pool(config)
    if config.meta_dir is not None:
        raise ConfigError("meta_dir", "not needed with a shared raw pool: every writer's journal, checkpoint, "
                                      "lease and config live in its region on the device; remove it")


# ---------------------------------------------------------------------------------------- host slots
def newest_header(magic: bytes, blocks: list[bytes], order: str, what: str) -> tuple[int, dict[str, Any]] | None:
    """Of ``blocks`` (A/B copies), (index, fields) of the valid header with the highest ``order`` field; None
    when neither is valid."""
    found = []
    for i, block in enumerate(blocks):
        try:
            found.append((i, fmt.unpack_header(magic, block, what)))
        except (CorruptRecordError, ValueError):
            continue
    return max(found, key=lambda f: int(f[1].get(order, -1)), default=None)


def read_host_lease(fd: int, sb: Superblock, host: int) -> dict[str, Any] | None:
    """Host ``host``'s lease: the valid block with the higher counter, or None."""
    data = read_at(fd, sb.slot_at(host), 2 * BLOCK)
    found = newest_header(fmt.HOST_LEASE_MAGIC, [data[:BLOCK], data[BLOCK:]], "counter", "host lease")
    return None if found is None else found[1]


def write_host_lease(fd: int, sb: Superblock, host: int, fields: dict[str, Any]) -> None:
    """Write ``fields`` (with its ``counter``) as host ``host``'s lease block ``counter % 2``, synced."""
    write_at(fd, sb.slot_at(host) + (int(fields["counter"]) % 2) * BLOCK, fmt.pack_header(fmt.HOST_LEASE_MAGIC, fields))


def table_at(sb: Superblock, host: int) -> int:
    return sb.slot_at(host) + fmt.HOST_TABLE_AT


def read_table(fd: int, sb: Superblock, host: int) -> tuple[int, list[dict[str, Any]]]:
    """Host ``host``'s region table: (generation, entries); (-1, []) when it has none yet."""
    copies = []
    for c in range(2):
        at = table_at(sb, host) + c * fmt.HOST_TABLE_BYTES
        head = read_at(fd, at, BLOCK)
        need = min(fmt.header_bytes(head), fmt.HOST_TABLE_BYTES)
        copies.append(head if need <= BLOCK else read_at(fd, at, need))
    found = newest_header(fmt.HOST_TABLE_MAGIC, copies, "generation", f"{sb.path} host {host} table")
    if found is None:
        return -1, []
    return int(found[1]["generation"]), list(found[1]["regions"])


def write_table(fd: int, sb: Superblock, host: int, generation: int, entries: list[dict[str, Any]]) -> None:
    """Write table ``generation`` into copy ``generation % 2`` (the other keeps the last one), synced.
    Raises DeviceError when it does not fit."""
    data = fmt.pack_header(fmt.HOST_TABLE_MAGIC, {"generation": generation, "regions": entries})
    if len(data) > fmt.HOST_TABLE_BYTES:
        raise DeviceError(f"{sb.path}: the region table of host_index {host} is full ({len(entries)} regions)")
    write_at(fd, table_at(sb, host) + (generation % 2) * fmt.HOST_TABLE_BYTES, data)
