"""A writer's ``Layout`` on the shared raw device: its regions' slots as arenas and its region's meta areas as
``Layout.files`` (``region_meta.open_regions``, each region's header checked as a device header, the store id
being the pool id). There is no meta directory: a namespace is named ``<first device>/ns-<digest>`` and a
writer ``<that>/w-<wid>``, names that ``regions`` resolves on the device.
"""

from __future__ import annotations

import errno
from pathlib import Path

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import CorruptRecordError
from sgl_kvtier.keys import Namespace
from sgl_kvtier.media.shared_raw.region_meta import open_regions, read_config
from sgl_kvtier.media.shared_raw.regions import pool_writers, region_read
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.format import writer_dirname
from sgl_kvtier.store.layout import Layout, slot_bytes_of


def raw_meta_dir(config: StoreConfig, namespace: Namespace) -> Path:
    """The namespace's name on the shared raw device (no directory: ``regions`` resolves it)."""
    return Path(config.devices[0]) / namespace.dirname()


def open_raw_layout(config: StoreConfig, namespace: Namespace, ns_meta: Path, wid: str, create: bool) -> Layout:
    """Open (with ``create``: claim-time make) writer ``wid``'s regions; with ``create`` its meta areas are
    checked to hold what its slots need (``RegionFiles.check_present``) before anything is written."""
    slot_bytes = slot_bytes_of(namespace)
    regions, files, pool_id = open_regions(config, namespace, ns_meta / writer_dirname(wid), wid, slot_bytes, create)
    layout = Layout(ns_meta / writer_dirname(wid), regions, slot_bytes, pool_id, wid, files)
    if create:
        try:
            files.check_present(namespace)
        except BaseException:
            layout.close()
            raise
    return layout


def load_raw_config(meta: Path) -> StoreConfig:
    """The config recorded in a shared raw writer's (or, for a namespace, its first writer's) CONFIG area.
    FileNotFoundError when there is none."""
    wids = pool_writers(meta)
    writer = meta if wids is None else meta / writer_dirname(wids[0]) if wids else None
    data = None if writer is None else region_read(writer, fmt.REGION_CONFIG_AT, fmt.REGION_CONFIG_BYTES)
    if data is None:
        raise FileNotFoundError(errno.ENOENT, "no region to read a CONFIG from", str(meta))
    try:
        return StoreConfig.from_mapping(read_config(data, str(meta / "CONFIG")))
    except CorruptRecordError as exc:
        raise FileNotFoundError(errno.ENOENT, f"no config recorded ({exc})", str(meta / "CONFIG")) from None
