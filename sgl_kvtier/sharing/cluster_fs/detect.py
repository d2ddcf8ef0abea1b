"""Which filesystem is under a path, and whether several hosts may mount it (``sharing = "cluster"``).

``detect``: ``os.statvfs`` (read-only mounts) plus ``/proc/self/mountinfo``: the mount whose mount point is
the longest prefix of the path's real path (preferring the path's own ``st_dev``, so an over-mount is seen
through; the last line wins a tie), and its fstype (FUSE by subtype, ``fuse.hf3fs``). Classes (``FsClass``):
  * LOCAL_ONLY: one host mounts it (ext4, XFS, btrfs, tmpfs, overlay, a block-backed FUSE, ...); two hosts
    mounting it read-write corrupt it, so cluster mode is refused there.
  * SHARED: made for several clients (NFS, Lustre, GPFS, CephFS, BeeGFS, SMB, GFS2/OCFS2, ``fuse.*`` except
    a few known local helpers, MooseFS's plain ``fuse`` by its ``mfs#`` source).
  * UNKNOWN: anything else (plain ``fuse``, virtiofs, no mountinfo): cluster mode proceeds with a warning.
Whether hosts really see one directory is ``check-shared --peer-wait``'s job (``sharing.cluster_fs.probes``).
Nothing here refuses anything: the open rules are ``sharing.cluster_fs.check``'s.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"
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


# Shared FUSE clients that mount with a plain ``fuse`` type, known by their mount source's prefix.
_SHARED_FUSE_SOURCES = ("mfs#",)  # MooseFS (``mfs#<master>:<port>``)


def classify(fstype: str, source: str = "") -> FsClass:
    """The class of a mountinfo fstype (``ext4``, ``nfs4``, ``fuse.hf3fs``, ...); a plain ``fuse`` mount by
    its ``source`` (``mfs#master:9421``: MooseFS)."""
    if fstype in _LOCAL or fstype in _LOCAL_FUSE:
        return FsClass.LOCAL_ONLY
    if fstype in _SHARED or fstype.startswith("fuse."):
        return FsClass.SHARED
    if fstype == "fuse" and source.startswith(_SHARED_FUSE_SOURCES):
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
    return FsInfo(str(path), m.mount_point, m.fstype, m.source, classify(m.fstype, m.source), read_only)


def local_fs_refusal(info: FsInfo) -> str:
    """Why cluster mode is refused on a LOCAL_ONLY filesystem (the ConfigError's text after the field)."""
    return (f"{info.describe()}: a filesystem only one host may mount; two hosts mounting it read-write "
            'corrupt it: use a shared filesystem (NFS, Lustre, GPFS, CephFS, 3FS, ...) or sharing = "host"; '
            "allow_local_fs = true only to try cluster mode on one host")
