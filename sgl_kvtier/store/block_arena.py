"""``BlockArena``: slots in a raw block device (or a regular file standing in for one). A region table in the
first ``BLOCK_HEADER_BYTES`` names each (namespace digest, wid)'s ``[offset, length)``, claimed under an
exclusive ``flock``. A device whose first MiB is neither zeros nor such a table is refused (never formatted
over); a shared raw pool's device (``media.shared_raw.superblock``) is refused naming what it needs. The
descriptor rules are ``store.devices``'s.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from typing import Any

from sgl_kvtier.errors import ConfigError, DeviceError
from sgl_kvtier.io.buffers import ALIGN
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.devices import Arena, check_header, open_file
from sgl_kvtier.store.lifecycle import release_all


class BlockArena(Arena):
    """An arena in a raw block device's region (claimed in the device's region table, one per (namespace
    shard, writer))."""

    def __init__(self, path: str, ns_digest: bytes, wid: str, header: dict[str, Any], slot_bytes: int,
                 share_bytes: int | None, shard_count: int, direct: str, create: bool):
        self.path = path
        self.slot_bytes = slot_bytes
        try:
            self._meta_fd = os.open(path, os.O_RDWR if create else os.O_RDONLY)
        except OSError as exc:
            raise DeviceError(f"{path}: cannot open: {exc.strerror}") from None
        try:
            size = os.lseek(self._meta_fd, 0, os.SEEK_END)
            fcntl.flock(self._meta_fd, fcntl.LOCK_EX)
            try:
                self.offset, length = self._claim_region(ns_digest, wid, header, size, share_bytes,
                                                         shard_count, create)
            finally:
                fcntl.flock(self._meta_fd, fcntl.LOCK_UN)
            self.capacity_slots = length // slot_bytes
            self.fd, self.direct = open_file(path, os.O_RDWR if create else os.O_RDONLY, direct)
        except BaseException:
            os.close(self._meta_fd)
            raise

    def _read_table(self, size: int) -> dict[str, Any] | None:
        head = os.pread(self._meta_fd, fmt.BLOCK_HEADER_BYTES, 0)
        if head.startswith(fmt.POOL_MAGIC):
            raise ConfigError("sharing", f'{self.path} is a shared raw pool (sgl-kvtier pool-format): it needs '
                                         'sharing = "cluster" and this host\'s host_index, and no meta_dir')
        if head[:len(fmt.REGION_MAGIC)] == fmt.REGION_MAGIC:
            return fmt.unpack_header(fmt.REGION_MAGIC, head, f"{self.path} region table")
        if head.count(0) != len(head):
            raise DeviceError(f"{self.path}: holds data that is not an sgl-kvtier store; refusing to format it. "
                              f"If it is free, zero its first MiB: dd if=/dev/zero of={self.path} bs=1M count=1")
        return None

    def _claim_region(self, ns_digest: bytes, wid: str, header: dict[str, Any], size: int,
                      share_bytes: int | None, shard_count: int, create: bool) -> tuple[int, int]:
        table = self._read_table(size) or {"regions": []}
        for region in table["regions"]:
            if region["ns"] == ns_digest and (region.get("wid") == wid or
                                              region["header"].get("format_version") != fmt.FORMAT_VERSION):
                check_header(region["header"], header, f"{self.path} region {ns_digest.hex()} of writer {wid}")
                return region["offset"], region["length"]
        if not create:
            raise DeviceError(f"{self.path}: no region for this namespace and writer {wid}")
        arena_bytes = size - fmt.BLOCK_HEADER_BYTES
        if share_bytes is None:
            share_bytes = arena_bytes // shard_count
        length = share_bytes // self.slot_bytes * self.slot_bytes
        start = max([fmt.BLOCK_HEADER_BYTES] + [r["offset"] + r["length"] for r in table["regions"]])
        start = (start + ALIGN - 1) // ALIGN * ALIGN
        if length < self.slot_bytes or start + length > size:
            raise DeviceError(f"{self.path}: too small: {size - start} bytes left, this shard needs "
                              f"{max(length, self.slot_bytes)} (slots of {self.slot_bytes} bytes)")
        header = {"format_version": fmt.FORMAT_VERSION, **header}
        table["regions"].append({"ns": ns_digest, "wid": wid, "offset": start, "length": length, "header": header})
        data = fmt.pack_header(fmt.REGION_MAGIC, table)
        if len(data) > fmt.BLOCK_HEADER_BYTES:
            raise DeviceError(f"{self.path}: region table full")
        os.pwrite(self._meta_fd, data, 0)
        os.fsync(self._meta_fd)
        return start, length

    def locate(self, local_slot: int) -> tuple[int, int]:
        return self.fd, self.offset + local_slot * self.slot_bytes

    def fds(self) -> list[int]:
        return [self.fd]

    def close(self) -> None:
        """Close the data and the region-table descriptors, both whatever the other raises. Idempotent."""
        fds, self.fd, self._meta_fd = [self.fd, self._meta_fd], -1, -1  # detached first: never closed twice
        release_all((f"{self.path} fd {fd}", partial(os.close, fd)) for fd in fds if fd >= 0)
