"""Resolve a config + namespace + writer id into one writer's part of a namespace on directory or raw devices.

Paths (``store.format``): ``<meta_dir or first device>/ns-<digest>/`` holds ``HEADER`` (devices in order,
slot size, parts, store id) and one directory per writer, ``w-<wid>/`` (``Layout.meta``). Every device
carries its own ``ns-<digest>/HEADER`` (same store id, its index) and the writer's segments under
``ns-<digest>/w-<wid>/``; a raw block device one region per (namespace digest, wid). Headers are made once,
by whichever writer comes first (``devices.create_once``), so two writers opening a new namespace at once
get one store id; a device list reordered, shortened or mixed with another store's is refused at open.

Refusals (``StoreFormatError``): another format, ``parts`` other than ``Namespace.part_sizes()``, and a
writer whose journal and checkpoint are gone while its segments (or raw region) hold pages
(``check_meta_present``: a new writer would overwrite pages it does not know; ``sgl-kvtier fsck --rebuild``
indexes them again). Under ``sharing = "cluster"`` every data file is opened with O_DIRECT or not at all
(``direct_mode``). The writer lock and the storage checks are the site's (``store.site.WriterSite``); a
shared raw pool's layout is ``media.shared_raw.layout``.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from sgl_kvtier.config import DirectIO, Sharing, StoreConfig
from sgl_kvtier.errors import CorruptRecordError, DeviceError, StoreFormatError
from sgl_kvtier.io.buffers import round_up
from sgl_kvtier.keys import Namespace
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.block_arena import BlockArena
from sgl_kvtier.store.devices import (
    DIRECT_CLUSTER,
    Arena,
    DirectoryArena,
    check_header,
    create_once,
    is_block_like,
)
from sgl_kvtier.store.format import writer_dirname
from sgl_kvtier.store.lifecycle import abandon, release_all
from sgl_kvtier.store.meta import WriterMeta

CHECKPOINT = "checkpoint.bin"


@dataclass
class Layout:
    """One writer's part of a namespace: its meta directory, one arena per device, and the slot size."""

    meta: Path  # the writer's directory ``<ns>/w-<wid>``
    arenas: list[Arena]
    slot_bytes: int
    store_id: str
    wid: str = ""
    files: WriterMeta | None = None  # a shared raw pool's writer: its meta areas (``media.shared_raw.region_meta``)

    @property
    def ns_meta(self) -> Path:
        """The namespace directory holding every writer's directory."""
        return self.meta.parent

    @property
    def capacity_slots(self) -> int:
        # Slot g lives on arena g % n; the usable prefix of global slots ends where the smallest arena ends.
        n = len(self.arenas)
        return min(a.capacity_slots * n + i for i, a in enumerate(self.arenas))

    @property
    def direct(self) -> bool:
        return all(a.direct for a in self.arenas)

    def prepare(self) -> None:
        """Once the writer's journal exists: let every arena make ready what the first puts need
        (``Arena.prepare``: a directory arena starts making its first segment in the background)."""
        for arena in self.arenas:
            arena.prepare()

    def settle(self) -> None:
        """Return once no arena has background work in flight (``Arena.settle``)."""
        for arena in self.arenas:
            arena.settle()

    def close(self) -> None:
        """Close every arena's files, each arena whatever the others raise (then the first error)."""
        steps = [(f"device {a.path}", a.close) for a in self.arenas]
        release_all(steps + ([] if self.files is None else [("region meta", self.files.close)]))


def meta_dir(config: StoreConfig, namespace: Namespace) -> Path:
    """The namespace's meta directory, ``<meta_dir or first device>/ns-<digest>`` (not created here)."""
    root = config.meta_dir or config.devices[0]
    field = "meta_dir" if config.meta_dir else "devices"
    if not os.path.exists(root):
        raise DeviceError(f"{field}: {root} does not exist")
    if not os.path.isdir(root):
        raise DeviceError(f"{field}: {root} is not a directory; raw block devices need a meta_dir for the journal")
    return Path(root) / namespace.dirname()


def slot_bytes_of(namespace: Namespace) -> int:
    """A slot's size in format 2: the page, then its trailer (a checksum per part), rounded up to 4 KiB."""
    return fmt.slot_bytes_for(namespace.page_bytes, parts=len(namespace.part_sizes()))


def load_config(meta: Path) -> StoreConfig:
    """The config a writer recorded (``save_config``) in ``meta``: a writer directory, or a namespace
    directory (then its first writer directory holding one)."""
    path = meta / "CONFIG"
    if not path.exists():  # (NotADirectoryError: a shared raw pool's name, ``sharing.sites.load_config``)
        path = next((p / "CONFIG" for p in sorted(meta.glob("w-*")) if (p / "CONFIG").exists()), path)
    return StoreConfig.from_mapping(msgpack.unpackb(path.read_bytes()))


def check_meta_present(config: StoreConfig, namespace: Namespace, meta: Path, wid: str) -> None:
    """Refuse to write into a writer directory whose journal and checkpoint are gone while its segments
    still hold data (see the module docstring)."""
    if (meta / CHECKPOINT).exists() or any(meta.glob("journal-*.log")):
        return
    for dev in config.devices:
        seg_dir = Path(dev) / namespace.dirname() / writer_dirname(wid)
        if os.path.isdir(dev):
            held = any(p.stat().st_size > 0 for p in seg_dir.glob("seg-*.dat"))
        else:
            held, seg_dir = _region_holds_pages(dev, namespace, wid), Path(f"{dev} (region of writer {wid})")
        if held:
            raise StoreFormatError(
                f"{meta}: the journal and checkpoint of writer {wid} are gone but {seg_dir} still holds pages; "
                f"rebuild its index from the pages with `sgl-kvtier fsck --rebuild {meta.parent}`, "
                f"or remove {seg_dir} (its pages are a cache)")


def _region_holds_pages(dev: str, namespace: Namespace, wid: str) -> bool:
    """Whether a raw device has a region of writer ``wid`` whose first slot carries one of the namespace's
    trailers. Slots are handed out lowest first and raw devices keep their bytes, so a region that ever
    held a page holds a trailer there; a region claimed by a writer that crashed before its first page
    (claimed before its first journal existed) holds none and is not refused."""
    try:
        fd = os.open(dev, os.O_RDONLY)
    except OSError:
        return False  # open_layout reports the device itself
    try:
        head = os.pread(fd, fmt.BLOCK_HEADER_BYTES, 0)
        if head[:len(fmt.REGION_MAGIC)] != fmt.REGION_MAGIC:
            return False
        table = fmt.unpack_header(fmt.REGION_MAGIC, head, dev)
        digest = namespace.digest()
        for region in table.get("regions", []):
            if region.get("ns") == digest and region.get("wid") == wid:
                slot = os.pread(fd, slot_bytes_of(namespace), region["offset"])
                trailer = fmt.unpack_trailer(slot[namespace.page_bytes:])
                return trailer is not None and trailer.ns_digest == digest
        return False
    except (OSError, CorruptRecordError, KeyError, TypeError):
        return False  # a damaged table is refused by open_layout with its own message
    finally:
        os.close(fd)


def _read_header(path: Path) -> dict[str, Any]:
    try:
        return fmt.unpack_header(fmt.HEADER_MAGIC, path.read_bytes(), str(path))
    except CorruptRecordError as exc:
        raise StoreFormatError(str(exc)) from None


def _namespace_header(config: StoreConfig, namespace: Namespace, ns_meta: Path, slot_bytes: int,
                      create: bool) -> tuple[dict[str, Any], bool]:
    """The namespace header (made now if ``create`` and absent), and whether it is the first device's."""
    path = ns_meta / "HEADER"
    dev0 = config.devices[0]
    on_dev0 = os.path.isdir(dev0) and ns_meta == Path(dev0) / namespace.dirname()
    if not path.exists():
        if not create:
            raise DeviceError(f"{ns_meta}: no store here")
        want = _device_header(config, namespace, ns_meta, slot_bytes, uuid.uuid4().hex, 0 if on_dev0 else -1)
        if not on_dev0:
            del want["meta_dir"]
        create_once(path, fmt.pack_header(fmt.HEADER_MAGIC, want))  # crash rule: linked complete, or absent
    header = _read_header(path)
    want = _device_header(config, namespace, ns_meta, slot_bytes, header.get("store_id"), 0 if on_dev0 else -1)
    want["device_count"] = header.get("device_count")  # a changed device list is open_layout's DeviceError
    check_header(header, want, str(path))
    return header, on_dev0


def _device_header(config: StoreConfig, namespace: Namespace, ns_meta: Path, slot_bytes: int, store_id: Any,
                   index: int) -> dict[str, Any]:
    return {"namespace": namespace.to_mapping(), "slot_bytes": slot_bytes, "parts": namespace.part_sizes(),
            "device_index": index, "device_count": len(config.devices), "store_id": store_id,
            "devices": list(config.devices), "meta_dir": str(ns_meta.parent)}


def direct_mode(config: StoreConfig) -> str:
    """How arenas open their files (``devices.open_file``): the config's ``direct_io``, except that "auto"
    means O_DIRECT or fail under ``sharing = "cluster"`` (``devices.DIRECT_CLUSTER``), for readers too:
    another host's pages are only seen past this host's page cache."""
    if config.sharing is Sharing.CLUSTER and config.direct_io is DirectIO.AUTO:
        return DIRECT_CLUSTER
    return config.direct_io.value


def _open_arena(config: StoreConfig, namespace: Namespace, wid: str, path: str, header: dict[str, Any],
                slot_bytes: int, share: int | None, create: bool) -> Arena:
    if is_block_like(path):
        return BlockArena(path, namespace.digest(), wid, header, slot_bytes, share, namespace.shard_count,
                          direct_mode(config), create)
    return DirectoryArena(path, namespace.dirname(), writer_dirname(wid), header, slot_bytes, config.segment_bytes,
                          None if share is None else share // slot_bytes, namespace.shard_count,
                          direct_mode(config), create)


def open_layout(config: StoreConfig, namespace: Namespace, ns_meta: Path, wid: str, create: bool) -> Layout:
    """Open (with ``create``: make) writer ``wid``'s arenas, checking every header against the config.

    Each writer may use the whole ``capacity_bytes`` (one pool-wide limit its store keeps against the
    others' leases): on each device it gets ``capacity_bytes / devices``, a raw device's region included,
    so several writers on one raw device each take such a region and the device's size (and its region
    table, ``BLOCK_HEADER_BYTES``) limits how many fit.

    Raises DeviceError (no store here without ``create``, a device that is not this store's) or
    StoreFormatError (headers that disagree, format 1, parts other than the namespace's).
    """
    slot_bytes = slot_bytes_of(namespace)
    ndev = len(config.devices)
    ns_header, _ = _namespace_header(config, namespace, ns_meta, slot_bytes, create)
    store_id = ns_header["store_id"]
    share = None if config.capacity_bytes is None else round_up(-(-config.capacity_bytes // ndev), slot_bytes)
    if ns_header.get("device_count") != ndev:
        raise DeviceError(f"devices: this store was made on {ns_header.get('devices')}, not {list(config.devices)}")
    arenas: list[Arena] = []
    try:
        for index, path in enumerate(config.devices):
            header = _device_header(config, namespace, ns_meta, slot_bytes, store_id, index)
            try:
                arenas.append(_open_arena(config, namespace, wid, path, header, slot_bytes, share, create))
            except DeviceError as exc:
                raise DeviceError(f"devices[{index}]: {exc}") from None
    except BaseException as exc:
        abandon(exc, str(ns_meta), [(f"device {a.path}", a.close) for a in arenas])
        raise
    return Layout(ns_meta / writer_dirname(wid), arenas, slot_bytes, store_id, wid)
