"""Resolve a config + namespace into the pieces of one namespace shard on disk, and lock it.

The *meta directory* ``<meta_dir or first device>/ns-<digest>/`` holds ``HEADER`` (which devices, in which
order, under which store id), ``LOCK`` (``flock``: one writer process per shard), the journals and the
checkpoint. Every device carries a header of its own naming the same store id and its index, so a device
list that was reordered, shortened or mixed with another store's devices is refused at open.

The writer lock is a ``flock`` on ``LOCK``, held through one descriptor from ``acquire_writer_lock`` until
``release_writer_lock`` (the last step of a writer's close); a failed ``acquire_writer_lock`` or
``open_layout`` closes whatever it opened before its error leaves it.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgpack

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import DeviceError, StoreLockedError
from sgl_kvtier.io.buffers import round_up
from sgl_kvtier.keys import Namespace
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.devices import Arena, BlockArena, DirectoryArena, check_header, is_block_like, write_file_atomic
from sgl_kvtier.store.lifecycle import abandon, release_all


@dataclass
class Layout:
    """One namespace shard on disk: its meta directory, one arena per device, and the slot size."""

    meta: Path
    arenas: list[Arena]
    slot_bytes: int
    store_id: str

    @property
    def capacity_slots(self) -> int:
        # Slot g lives on arena g % n; the usable prefix of global slots ends where the smallest arena ends.
        n = len(self.arenas)
        return min(a.capacity_slots * n + i for i, a in enumerate(self.arenas))

    @property
    def direct(self) -> bool:
        return all(a.direct for a in self.arenas)

    def close(self) -> None:
        """Close every arena's files, each arena whatever the others raise (then the first error)."""
        release_all((f"device {a.path}", a.close) for a in self.arenas)


def meta_dir(config: StoreConfig, namespace: Namespace) -> Path:
    """The shard's meta directory, ``<meta_dir or first device>/ns-<digest>`` (not created here)."""
    root = config.meta_dir or config.devices[0]
    field = "meta_dir" if config.meta_dir else "devices"
    if not os.path.exists(root):
        raise DeviceError(f"{field}: {root} does not exist")
    if not os.path.isdir(root):
        raise DeviceError(f"{field}: {root} is not a directory; raw block devices need a meta_dir for the journal")
    return Path(root) / namespace.dirname()


def acquire_writer_lock(meta: Path) -> int:
    """Create the shard's meta directory if needed and take its writer lock (non-blocking)."""
    try:
        meta.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(meta / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise DeviceError(f"{meta.parent}: not writable ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            raise StoreLockedError(f"{meta}: already open for writing by pid {holder}; "
                                   "one writer process per namespace shard") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except BaseException as exc:
        abandon(exc, str(meta), [("writer lock", partial(release_writer_lock, fd))])
        raise
    return fd


def release_writer_lock(fd: int) -> None:
    """Give the writer lock up and close its descriptor, both attempted whatever the other raises.

    The explicit unlock frees the lock even where a forked child still shares the descriptor (a flock
    belongs to the open file, not the process). Called last by a writer's close: crash rule, the next
    writer may start only once every file of this one is closed.
    """
    release_all([("unlock", partial(fcntl.flock, fd, fcntl.LOCK_UN)), ("close", partial(os.close, fd))])


def save_config(meta: Path, config: StoreConfig) -> None:
    """Record the config a writer used, so offline tools (inspect, fsck) see the same devices and limits."""
    write_file_atomic(meta / "CONFIG", msgpack.packb(config.to_mapping()))


def load_config(meta: Path) -> StoreConfig:
    """The config the shard's last writer recorded (``save_config``)."""
    return StoreConfig.from_mapping(msgpack.unpackb((meta / "CONFIG").read_bytes()))


def _open_arena(config: StoreConfig, namespace: Namespace, path: str, header: dict[str, Any], slot_bytes: int,
                share: int | None, create: bool) -> Arena:
    if is_block_like(path):
        return BlockArena(path, namespace.digest(), header, slot_bytes, share, namespace.shard_count,
                          config.direct_io.value, create)
    return DirectoryArena(path, namespace.dirname(), header, slot_bytes, config.segment_bytes,
                          None if share is None else share // slot_bytes, namespace.shard_count,
                          config.direct_io.value, create)


def open_layout(config: StoreConfig, namespace: Namespace, meta: Path, create: bool) -> Layout:
    """Open (with ``create``: make) the shard's arenas, checking every device header against the config.

    Raises DeviceError (no store here without ``create``, a device that is not this store's) or
    StoreFormatError (headers that disagree).
    """
    slot_bytes = round_up(namespace.page_bytes)
    header_path = meta / "HEADER"
    ndev = len(config.devices)
    meta_header = None
    if header_path.exists():
        meta_header = fmt.unpack_header(fmt.HEADER_MAGIC, header_path.read_bytes(), str(header_path))
    elif not create:
        raise DeviceError(f"{meta}: no store here")
    store_id = meta_header["store_id"] if meta_header else uuid.uuid4().hex
    share = None if config.capacity_bytes is None else round_up(-(-config.capacity_bytes // ndev), slot_bytes)
    arenas: list[Arena] = []
    try:
        for index, path in enumerate(config.devices):
            header = {"namespace": namespace.to_mapping(), "slot_bytes": slot_bytes, "device_index": index,
                      "device_count": ndev, "store_id": store_id, "devices": list(config.devices),
                      "meta_dir": str(meta.parent)}
            if meta_header is not None and index == 0 and meta == Path(path) / namespace.dirname():
                check_header(meta_header, header, str(header_path))
            try:
                arenas.append(_open_arena(config, namespace, path, header, slot_bytes, share, create))
            except DeviceError as exc:
                raise DeviceError(f"devices[{index}]: {exc}") from None
        if meta_header is None:
            if meta != Path(config.devices[0]) / namespace.dirname() or not header_path.exists():
                write_file_atomic(header_path, fmt.pack_header(fmt.HEADER_MAGIC, {
                    "namespace": namespace.to_mapping(), "slot_bytes": slot_bytes, "device_index": -1,
                    "device_count": ndev, "store_id": store_id, "devices": list(config.devices)}))
        elif meta_header.get("device_count") != ndev:
            raise DeviceError(f"devices: this store was made on {meta_header.get('devices')}, not {list(config.devices)}")
    except BaseException as exc:
        abandon(exc, str(meta), [(f"device {a.path}", a.close) for a in arenas])
        raise
    return Layout(meta, arenas, slot_bytes, store_id)
