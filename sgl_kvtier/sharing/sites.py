"""The ``store.site.WriterSite`` of a config (``site_for``), chosen once at open: ``DirectorySite`` for
devices that are directories or block devices with a meta directory, ``SharedRawSite`` for the shared raw
device (``host_index`` set), ``SoleSite`` for a namespace shard's one writer (``sharing = "off"``). Each runs
the sharing mode's storage checks (``sharing.cluster_fs.check``) first. The shared sites beat a lease
(``sharing.lease``; on the shared raw device each beat also beats this host's lease of its slot); the sole
site beats none: its held LOCK alone says it is live. No namespace has a sole and a shared writer live at once
(``writers.refuse_mixed_modes``). ``open_writer`` opens a ``PageStore`` on its config's site; ``load_config``
reads a recorded CONFIG from either medium.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sgl_kvtier.config import Sharing, StoreConfig
from sgl_kvtier.errors import ConfigError, StoreFormatError
from sgl_kvtier.keys import Namespace
from sgl_kvtier.media.shared_raw.layout import load_raw_config, open_raw_layout, raw_meta_dir
from sgl_kvtier.media.shared_raw.region_meta import RegionFiles
from sgl_kvtier.media.shared_raw.superblock import superblock_of
from sgl_kvtier.sharing import shared_raw_claim
from sgl_kvtier.sharing.cluster_fs.check import check_cluster_open
from sgl_kvtier.sharing.lease import Lease
from sgl_kvtier.sharing.writers import boot_id, claim_writer, machine_id, refuse_mixed_modes
from sgl_kvtier.store import layout
from sgl_kvtier.store.devices import fsync_dir
from sgl_kvtier.store.layout import Layout
from sgl_kvtier.store.lifecycle import abandon
from sgl_kvtier.store.meta import LEASE, LeaseBlocks
from sgl_kvtier.store.page_store import PageStore
from sgl_kvtier.store.site import Claim, Closeable, Heartbeat, Writer, WriterSite

StartedLease = tuple[Heartbeat | None, Closeable | None, Callable[[], str | None] | None]


class DirectorySite:
    """Devices that are directories (or block devices) and a meta directory holding every writer's own."""

    def __init__(self, config: StoreConfig):
        self.config = config

    def check_storage(self) -> None:
        check_cluster_open(self.config)

    def meta_dir(self, namespace: Namespace) -> Path:
        for dev in self.config.devices:
            if not os.path.isdir(dev) and superblock_of(dev) is not None:
                raise ConfigError("host_index", f'{dev} is a shared raw pool (sgl-kvtier pool-format): it needs '
                                                'sharing = "cluster" and this host\'s host_index (0..hosts-1), '
                                                'and no meta_dir')
        return layout.meta_dir(self.config, namespace)

    def claim(self, namespace: Namespace, ns_meta: Path, wid: str | None) -> Claim:
        claim = claim_writer(self.config, ns_meta, wid)
        if wid is None:  # a new writer (a reclaim's dead writer is of this mode already)
            try:
                refuse_mixed_modes(self.config, ns_meta, claim.wid, sole=False)
            except BaseException as exc:
                abandon(exc, str(claim.path), [("writer lock", claim.release)])
                raise
        return claim

    def check_meta_present(self, namespace: Namespace, meta: Path, wid: str) -> None:
        layout.check_meta_present(self.config, namespace, meta, wid)

    def open_layout(self, namespace: Namespace, ns_meta: Path, wid: str, create: bool) -> Layout:
        return layout.open_layout(self.config, namespace, ns_meta, wid, create)

    def start_lease(self, store: Writer) -> StartedLease:
        lease = Lease(store.claim.path / LEASE, _identity(store), store.usage, self.config.heartbeat_s)
        return _started(lease), None, None


class SharedRawSite(DirectorySite):
    """The shared raw device: regions claimed in this host's slot, meta in each region's areas."""

    def meta_dir(self, namespace: Namespace) -> Path:
        return raw_meta_dir(self.config, namespace)

    def claim(self, namespace: Namespace, ns_meta: Path, wid: str | None) -> Claim:
        return shared_raw_claim.claim(self.config, namespace, wid)

    def check_meta_present(self, namespace: Namespace, meta: Path, wid: str) -> None:
        pass  # a region's areas are checked once open (``open_raw_layout``: ``RegionFiles.check_present``)

    def open_layout(self, namespace: Namespace, ns_meta: Path, wid: str, create: bool) -> Layout:
        return open_raw_layout(self.config, namespace, ns_meta, wid, create)

    def start_lease(self, store: Writer) -> StartedLease:
        files = store.layout.files
        if not isinstance(files, RegionFiles):
            raise StoreFormatError(f"{store.layout.meta}: a shared raw writer without its region's meta areas")
        host = shared_raw_claim.HostLease(files.dev, files.sb, int(self.config.host_index or 0),
                                          shared_raw_claim.host_identity(self.config))
        try:  # each beat also beats the host lease, whose table names this machine
            blocks: LeaseBlocks = files.lease_blocks(host.beat)
            identity = {**_identity(store), "host_index": self.config.host_index}
            lease = _started(Lease(store.claim.path / LEASE, identity, store.usage, self.config.heartbeat_s,
                                   blocks=blocks))
        except BaseException:
            host.close()
            raise
        return lease, host, host.taken_over


class SoleSite(DirectorySite):
    """A namespace shard's one writer (``sharing = "off"``): ``w-<host_id>-0`` only, and no lease.

    With the store's CONFIG recorded, ``start_lease`` refuses it while another writer of the namespace holds
    its LOCK (``writers.refuse_mixed_modes``) and removes a LEASE an earlier shared writer left in its
    directory: no observer counts, reclaims or retires this writer by a lease it no longer beats."""

    def claim(self, namespace: Namespace, ns_meta: Path, wid: str | None) -> Claim:
        return claim_writer(self.config, ns_meta, wid, sole=True)

    def start_lease(self, store: Writer) -> StartedLease:
        refuse_mixed_modes(self.config, store.layout.ns_meta, store.wid, sole=True)
        try:
            (store.claim.path / LEASE).unlink()
        except FileNotFoundError:
            pass
        else:
            fsync_dir(store.claim.path)
        return None, None, None


def _started(lease: Lease) -> Lease:
    """``lease`` with its beat thread started; closed (its blocks released) when the start fails."""
    try:
        lease.start()
    except BaseException:
        lease.close()
        raise
    return lease


def _identity(store: Writer) -> dict[str, Any]:
    return {"wid": store.wid, "host_id": store.claim.host_id, "machine_id": machine_id(), "boot_id": boot_id(),
            "pid": os.getpid(), "incarnation": store.incarnation}


def site_for(config: StoreConfig) -> WriterSite:
    """The site of ``config``'s writers: the shared raw device when ``host_index`` is set (``sharing =
    "cluster"`` only), else directories: the sole writer's under ``sharing = "off"``."""
    if config.host_index is not None:
        return SharedRawSite(config)
    return SoleSite(config) if config.sharing is Sharing.OFF else DirectorySite(config)


def open_writer(config: StoreConfig, namespace: Namespace, **kwargs: Any) -> PageStore:
    """``PageStore.open`` on ``config``'s site (see there for the arguments and what it raises)."""
    return PageStore.open(config, namespace, site=site_for(config), **kwargs)


def load_config(meta: Path) -> StoreConfig:
    """The config a writer recorded in ``meta`` (a writer's or a namespace's meta directory or name), on
    either medium. FileNotFoundError when none is recorded."""
    try:
        return layout.load_config(meta)
    except NotADirectoryError:  # a shared raw pool's writer (or namespace): its region's CONFIG area
        return load_raw_config(meta)
