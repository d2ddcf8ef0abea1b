"""The storage checks a writer's site makes under ``sharing = "cluster"`` before any file is made
(``store.site.WriterSite.check_storage``; a no-op in any other mode).

Open rules (``check_cluster_open``): raw block devices must be one shared raw pool
(``media.shared_raw.superblock.check_pool_open``), and ``host_index`` is refused for directories; a device
or the ``meta_dir`` on a LOCAL_ONLY filesystem (``sharing.cluster_fs.detect``) is refused unless
``allow_local_fs`` (UNKNOWN logs one warning per mount); O_DIRECT must write and read back a block in every
device directory (``sharing.cluster_fs.probes.probe_direct_io``; "auto" ``direct_io`` means "on" here,
``store.layout.direct_mode``). Every refusal is a ``ConfigError`` naming the field, but a directory the
probe cannot write in (``DeviceError``). Paths go in config order, devices before the meta_dir; the first
refusal is raised.
"""

from __future__ import annotations

import logging
import os

from sgl_kvtier.config import Sharing, StoreConfig
from sgl_kvtier.errors import ConfigError, DeviceError
from sgl_kvtier.media.shared_raw.superblock import check_pool_open
from sgl_kvtier.sharing.cluster_fs.detect import FsClass, FsInfo, detect, local_fs_refusal
from sgl_kvtier.sharing.cluster_fs.probes import probe_direct_io
from sgl_kvtier.store.devices import is_block_like

log = logging.getLogger(__name__)
_warned_unknown: set[tuple[str, str]] = set()


def check_cluster_open(config: StoreConfig, mountinfo: str | None = None) -> list[FsInfo]:
    """Enforce the open rules of ``sharing = "cluster"`` (module docstring) on every device and the
    meta_dir; the filesystems found ([] in any other mode). A path that does not exist is left to the
    layout's own errors. Raises ConfigError naming the field and the path, DeviceError (a directory where
    the O_DIRECT probe cannot even write)."""
    if config.sharing is not Sharing.CLUSTER:
        return []
    if os.path.exists(config.devices[0]) and is_block_like(config.devices[0]):
        check_pool_open(config)  # a shared raw pool: no filesystem to check
        return []
    if config.host_index is not None:
        raise ConfigError("host_index", f"only for a shared raw pool (sgl-kvtier pool-format); {config.devices[0]} "
                                        "is a directory: remove host_index")
    places = [(f"devices[{i}]", d) for i, d in enumerate(config.devices)]
    if config.meta_dir is not None:
        places.append(("meta_dir", config.meta_dir))
    found = []
    for name, path in places:
        if not os.path.exists(path):
            continue
        if name != "meta_dir" and is_block_like(path):
            raise ConfigError(name, f"{path} is a raw device, but devices[0] is a directory: a shared raw pool "
                                    "is raw devices only, a shared filesystem pool directories only")
        info = detect(path, mountinfo)
        found.append(info)
        if info.fs_class is FsClass.LOCAL_ONLY and not config.allow_local_fs:
            raise ConfigError(name, local_fs_refusal(info))
        if info.fs_class is FsClass.UNKNOWN and (info.fstype, info.mount_point) not in _warned_unknown:
            _warned_unknown.add((info.fstype, info.mount_point))
            log.warning('%s: %s: not known to be a shared filesystem; sharing = "cluster" needs every host to '
                        "see one filesystem there (check with `sgl-kvtier check-shared %s --peer-wait 60` on "
                        "two hosts at once)", name, info.describe(), path)
        if name != "meta_dir":
            try:
                why = probe_direct_io(path)
            except OSError as exc:
                raise DeviceError(f"{name}: {path}: not writable ({exc.strerror})") from None
            if why is not None:
                raise ConfigError("direct_io", f'{path}: {why}; sharing = "cluster" needs O_DIRECT ("auto" means '
                                               '"on" there): another host\'s writes are only seen past the page '
                                               "cache")
    return found
