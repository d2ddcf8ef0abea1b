"""What ``sharing = "cluster"`` requires of the storage: the filesystem under a path, the checks made at open,
and the probes of ``sgl-kvtier check-shared``.

Detection (``detect``): ``os.statvfs`` (the path is there; read-only mounts) plus ``/proc/self/mountinfo``:
the mount whose mount point is the longest prefix of the path's real path (preferring mounts of the path's
own ``st_dev``, so an over-mount that hides a deeper one is seen through; the last line wins a tie), and its
fstype, which names FUSE filesystems by subtype (``fuse.hf3fs``). Classes (``FsClass``):
  * LOCAL_ONLY: a filesystem one host mounts (ext2/3/4, XFS, btrfs, tmpfs, overlay, ZFS, f2fs, vfat, a
    block-backed FUSE, ...). Two hosts mounting one read-write corrupt it: cluster mode is refused there.
  * SHARED: made for several clients (NFS, Lustre, GPFS, CephFS, BeeGFS, Weka, SMB, 9p, GFS2/OCFS2, and
    ``fuse.*`` such as 3FS's ``fuse.hf3fs``, except a few known local FUSE helpers).
  * UNKNOWN: anything else (plain ``fuse``, virtiofs, no mountinfo): cluster mode proceeds with a warning.
A LOCAL_ONLY filesystem exported by mistake, or a SHARED class that each host mounts apart, is not
visible from one host: ``check-shared --peer-wait`` run on two hosts at once shows that they see one
directory.

Open rules (``check_cluster_open``, called by ``PageStore.open`` before any file is made; a no-op unless
``sharing = "cluster"``): raw block devices must be one shared raw pool (``pool_dev.check_pool_open``: formatted
by ``sgl-kvtier pool-format``, ``host_index`` set, no ``meta_dir``; else ``devices[i]`` / ``host_index`` /
``meta_dir``), and ``host_index`` is refused for directories; a device or the ``meta_dir`` on a
LOCAL_ONLY filesystem is refused (``devices[i]`` / ``meta_dir``) unless ``allow_local_fs``; UNKNOWN logs
one warning per mount; O_DIRECT must write and read back a block in every device directory
(``direct_io``: "auto" means "on" here, see ``layout.direct_mode``). All ``ConfigError``s naming the field,
but a directory the probe cannot write in (``DeviceError``).
"""

from __future__ import annotations

import enum
import errno
import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sgl_kvtier.config import Sharing, StoreConfig
from sgl_kvtier.errors import ConfigError, DeviceError
from sgl_kvtier.io.buffers import ALIGN, AlignedBuffer
from sgl_kvtier.store.devices import create_once, fsync_dir, is_block_like, write_file_atomic
from sgl_kvtier.store.pool_dev import check_pool_open
from sgl_kvtier.store.writers import boot_id, machine_id

log = logging.getLogger(__name__)
MOUNTINFO = "/proc/self/mountinfo"
PEER_PREFIX = ".kvtier-peer-"  # check-shared --peer-wait: one probe file per running check
PEER_POLL_S = 0.2  # how often a peer wait looks at the directory
_warned_unknown: set[tuple[str, str]] = set()
_ESCAPE = re.compile(r"\\([0-7]{3})")


class FsClass(str, enum.Enum):
    """Whether a filesystem may be mounted by several hosts at once (see the module docstring)."""

    LOCAL_ONLY = "local_only"
    SHARED = "shared"
    UNKNOWN = "unknown"


_LOCAL = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "bcachefs", "tmpfs", "ramfs", "devtmpfs", "overlay", "aufs", "zfs",
    "f2fs", "vfat", "msdos", "exfat", "ntfs", "ntfs3", "hfs", "hfsplus", "jfs", "reiserfs", "nilfs2", "minix",
    "squashfs", "erofs", "iso9660", "udf", "fuseblk"})
_SHARED = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "ceph", "beegfs", "wekafs", "cifs", "smb3", "smbfs", "9p", "gfs2",
    "ocfs2", "glusterfs", "afs", "orangefs", "pvfs2", "panfs", "cvfs", "quobyte"})
# FUSE filesystems that only ever show this host's own files.
_LOCAL_FUSE = frozenset({"fuse.lxcfs", "fuse.gvfsd-fuse", "fuse.portal", "fuse.xdg-document-portal",
                         "fuse.fuse-overlayfs", "fuse.squashfuse", "fuse.encfs", "fuse.gocryptfs"})


def classify(fstype: str) -> FsClass:
    """The class of a mountinfo fstype (``ext4``, ``nfs4``, ``fuse.hf3fs``, ...)."""
    if fstype in _LOCAL or fstype in _LOCAL_FUSE:
        return FsClass.LOCAL_ONLY
    if fstype in _SHARED or fstype.startswith("fuse."):
        return FsClass.SHARED
    return FsClass.UNKNOWN


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo: ``dev`` is ``major:minor``; ``mount_point`` unescaped."""

    dev: str
    mount_point: str
    fstype: str
    source: str


@dataclass(frozen=True)
class FsInfo:
    """The filesystem under ``path``: its mount, type, class, and whether it is mounted read-only."""

    path: str
    mount_point: str
    fstype: str
    source: str
    fs_class: FsClass
    read_only: bool

    def describe(self) -> str:
        return f"{self.fstype or 'an unknown filesystem'} at {self.path} (mounted at {self.mount_point})"


def _unescape(text: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space, ``\\011``, ``\\012``, ``\\134``)."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)


def parse_mountinfo(text: str) -> list[Mount]:
    """Every well-formed line of a ``/proc/<pid>/mountinfo`` text, in order (see proc(5))."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) < sep + 3:
            continue
        mounts.append(Mount(fields[2], _unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2])))
    return mounts


def _read_mountinfo() -> str:
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def detect(path: str | Path, mountinfo: str | None = None) -> FsInfo:
    """The filesystem under ``path`` (which must exist: FileNotFoundError otherwise). ``mountinfo``: the
    text to read instead of ``/proc/self/mountinfo`` (tests)."""
    vfs = os.statvfs(path)
    real = os.path.realpath(path)
    st_dev = os.stat(real).st_dev
    dev = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    mounts = parse_mountinfo(_read_mountinfo() if mountinfo is None else mountinfo)
    under = [(len(m.mount_point), i, m) for i, m in enumerate(mounts)
             if m.mount_point == "/" or real == m.mount_point or real.startswith(m.mount_point.rstrip("/") + "/")]
    own = [c for c in under if c[2].dev == dev]
    best = max(own or under, default=None, key=lambda c: (c[0], c[1]))
    read_only = bool(vfs.f_flag & os.ST_RDONLY)
    if best is None:
        return FsInfo(str(path), "/", "", "", FsClass.UNKNOWN, read_only)
    m = best[2]
    return FsInfo(str(path), m.mount_point, m.fstype, m.source, classify(m.fstype), read_only)


def local_fs_refusal(info: FsInfo) -> str:
    """Why cluster mode is refused on a LOCAL_ONLY filesystem (the ConfigError's text after the field)."""
    return (f"{info.describe()}: a filesystem only one host may mount; two hosts mounting it read-write "
            'corrupt it: use a shared filesystem (NFS, Lustre, GPFS, CephFS, 3FS, ...) or sharing = "host"; '
            "allow_local_fs = true only to try cluster mode on one host")


def probe_direct_io(directory: str | Path) -> str | None:
    """Write one aligned block with O_DIRECT to a private file in ``directory``, read it back and remove
    the file: None when that works, else why not. Errors other than the filesystem refusing O_DIRECT
    (EINVAL) raise OSError."""
    path = Path(directory) / f".kvtier-odirect-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    buf = AlignedBuffer(ALIGN)
    pattern = os.urandom(16) * (ALIGN // 16)
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return "the filesystem refuses to open a file with O_DIRECT"
            raise
        try:
            buf.view[:] = pattern
            if os.pwritev(fd, [buf.view], 0) != ALIGN:
                return "a short O_DIRECT write"
            buf.view[:] = bytes(ALIGN)
            if os.preadv(fd, [buf.view], 0) != ALIGN or bytes(buf.view) != pattern:
                return "an O_DIRECT read did not return the block just written"
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return f"O_DIRECT IO fails ({exc.strerror})"
            raise
        finally:
            os.close(fd)
        return None
    finally:
        buf.close()
        path.unlink(missing_ok=True)


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


# ---------------------------------------------------------------------------------------------- check-shared
@dataclass(frozen=True)
class Probe:
    """One property check-shared tried: its name, whether it works, and what was seen."""

    name: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class SharedCheck:
    """What check-shared found in one directory; ``problems`` are why it is not fit for cluster mode."""

    path: str
    fs: FsInfo
    probes: tuple[Probe, ...]
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()
    peer: dict[str, Any] | None = field(default=None)

    @property
    def fit(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fs"]["fs_class"] = self.fs.fs_class.value
        out["fit"] = self.fit
        return out


def _probe(name: str, step: Callable[[], str | None]) -> Probe:
    try:
        why = step()
    except OSError as exc:
        why = f"{exc.strerror or exc} (errno {exc.errno})"
    return Probe(name, why is None, why or "")


def _probe_create_once(directory: Path) -> str | None:
    path = directory / f".kvtier-once-{uuid.uuid4().hex[:8]}"
    try:
        create_once(path, b"first")
        create_once(path, b"second")  # a link never replaces a file: the first one stays
        got = path.read_bytes()
        return None if got == b"first" else f"the second create replaced the first ({got!r})"
    finally:
        path.unlink(missing_ok=True)


def _probe_rename(directory: Path) -> str | None:
    path = directory / f".kvtier-rename-{uuid.uuid4().hex[:8]}"
    try:
        write_file_atomic(path, b"old")
        write_file_atomic(path, b"new")  # tmp + fsync + rename over an existing file + fsync of the directory
        got = path.read_bytes()
        return None if got == b"new" else f"read {got!r} after renaming b'new' over it"
    finally:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)


def _probe_fsync(directory: Path) -> str | None:
    path = directory / f".kvtier-fsync-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"x" * ALIGN)
            os.fsync(fd)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        fsync_dir(directory)
        return None
    finally:
        path.unlink(missing_ok=True)


def _identity() -> dict[str, Any]:
    return {"host": socket.gethostname(), "boot_id": boot_id(), "machine_id": machine_id(), "pid": os.getpid()}


def wait_for_peer(directory: Path, seconds: float, *, sleep: Callable[[float], None] = time.sleep,
                  clock: Callable[[], float] = time.monotonic) -> dict[str, Any] | None:
    """Leave a probe naming this host in ``directory`` and wait up to ``seconds`` for the probe of another
    host (another boot_id or machine_id) written at most ``seconds`` (+5 s) before this wait began; the
    peer's identity, or None.

    Each probe lists (``seen``) the probes its writer found. Once a peer is found, ours says so and stays
    until the peer's lists ours or is gone (the peer finished), or the time is up: so a peer that came later
    sees ours too, however late it first looks. Ours is removed at the end."""
    me = _identity()
    mine = directory / f"{PEER_PREFIX}{uuid.uuid4().hex}.json"
    since = time.time() - seconds - 5.0
    write_file_atomic(mine, json.dumps({**me, "seen": []}).encode())
    deadline = clock() + seconds
    found: tuple[Path, dict[str, Any]] | None = None
    try:
        while True:
            if found is None:
                found = _find_peer(directory, mine, me, since)
                if found is not None:
                    write_file_atomic(mine, json.dumps({**me, "seen": [found[0].name]}).encode())
            if found is not None:
                now = _read_probe(found[0])
                if now is None or mine.name in (now.get("seen") or []):
                    return found[1]
            left = deadline - clock()
            if left <= 0:
                return None if found is None else found[1]
            sleep(min(PEER_POLL_S, left))
    finally:
        mine.unlink(missing_ok=True)


def _read_probe(path: Path) -> dict[str, Any] | None:
    try:
        probe = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return probe if isinstance(probe, dict) else None


def _find_peer(directory: Path, mine: Path, me: dict[str, Any], since: float) -> tuple[Path, dict[str, Any]] | None:
    for path in sorted(directory.glob(PEER_PREFIX + "*.json")):
        if path == mine:
            continue
        try:
            if path.stat().st_mtime < since:
                continue  # left by a check that ran long before this one
        except OSError:
            continue
        other = _read_probe(path)
        if other is not None and (other.get("boot_id"), other.get("machine_id")) != (me["boot_id"], me["machine_id"]):
            return path, {k: v for k, v in other.items() if k != "seen"}
    return None


def check_shared(directory: str | Path, *, peer_wait_s: float | None = None, mountinfo: str | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> SharedCheck:
    """Probe ``directory`` for cluster mode: the filesystem and its class, O_DIRECT, create-once (O_EXCL +
    hard link), rename over a file, fsync of a file and the directory; with ``peer_wait_s``, another host's
    probe (``wait_for_peer``). Raises DeviceError when ``directory`` is not a directory."""
    path = Path(directory)
    if not path.is_dir():
        raise DeviceError(f"{directory}: not a directory")
    info = detect(path, mountinfo)
    problems: list[str] = []
    notes: list[str] = []
    if info.fs_class is FsClass.LOCAL_ONLY:
        problems.append(local_fs_refusal(info))
    elif info.fs_class is FsClass.UNKNOWN:
        notes.append(f"{info.describe()}: not known to be shared; run this with --peer-wait on two hosts at once")
    if info.read_only:
        problems.append(f"{info.describe()}: mounted read-only")
    probes = (_probe("O_DIRECT", lambda: probe_direct_io(path)),
              _probe("create-once (O_EXCL + hard link)", lambda: _probe_create_once(path)),
              _probe("rename over a file", lambda: _probe_rename(path)),
              _probe("fsync (file and directory)", lambda: _probe_fsync(path)))
    problems += [f"{p.name}: {p.detail}" for p in probes if not p.ok]
    peer = None
    if peer_wait_s is not None:
        try:
            peer = wait_for_peer(path, peer_wait_s, sleep=sleep)
        except OSError as exc:
            problems.append(f"peer probe: {exc.strerror}")
        else:
            if peer is None:
                problems.append(f"no other host's probe appeared in {peer_wait_s:g} s (run this on another host "
                                "at the same time; if it runs, the two do not see one filesystem here)")
    return SharedCheck(str(directory), info, probes, tuple(problems), tuple(notes), peer)
