"""Devices as slot arenas: where local slot ``n`` of one writer's part of a namespace lives on one device.

``DirectoryArena`` (a mounted filesystem): ``<dir>/ns-<digest>/HEADER`` (made once, ``create_once``) and
writer ``wid``'s preallocated ``<dir>/ns-<digest>/w-<wid>/seg-NNNNN.dat`` of ``segment_bytes``, created
ahead of need on a thread of the arena (``store.segment_ahead``: the first at open, the next once a slot in
the upper half of the last one is used), or by the put that needs one first. A raw block device is
``store.block_arena.BlockArena``.

A read-only arena (``create=False``) never creates nor writes a file: a segment not there is an OSError
for that read, which the read path turns into a miss. Files are created 0600, directories 0700. O_DIRECT
is probed per device: a filesystem refusing it gets buffered IO with fdatasync and one warning, except under
``sharing = "cluster"`` (``DIRECT_CLUSTER``), where it fails the open. Every descriptor an arena opens is
closed by its idempotent ``close`` or, when its construction fails, before the error leaves
(``store.lifecycle``). The crash rules of directories and atomic files (``make_dir``, ``create_once``,
``write_file_atomic``) are in their docstrings.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import uuid
from functools import partial
from pathlib import Path
from typing import Any

from sgl_kvtier.errors import CorruptRecordError, DeviceError, StoreFormatError
from sgl_kvtier.io.buffers import ALIGN, AlignedBuffer
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import holes
from sgl_kvtier.store.lifecycle import abandon, release_all, weak_method
from sgl_kvtier.store.segment_ahead import SegmentAhead

log = logging.getLogger(__name__)
_warned_buffered: set[str] = set()


DIRECT_CLUSTER = "cluster"  # the ``direct`` mode of ``direct_io = "auto"`` under ``sharing = "cluster"``


def open_file(path: str, flags: int, direct: str) -> tuple[int, bool]:
    """Open with O_DIRECT when ``direct`` allows and the filesystem accepts it; returns (fd, is_direct).
    ``direct``: "auto" (else buffered, one warning per directory), "on" (else DeviceError), "off", or
    ``DIRECT_CLUSTER`` (as "on", the error naming cluster mode: another host's writes are only seen past
    the page cache, so no file of a cluster pool falls back to buffered IO)."""
    if direct != "off":
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o600)
            try:
                works = _direct_read_works(fd)
            except BaseException:
                os.close(fd)
                raise
            if works:
                return fd, True
            os.close(fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        if direct == "on":
            raise DeviceError(f"{path}: O_DIRECT is not supported here but direct_io is 'on'")
        if direct == DIRECT_CLUSTER:
            raise DeviceError(f"{path}: O_DIRECT is not supported here, and sharing = \"cluster\" needs it "
                              "(direct_io = \"auto\" means \"on\" there: another host's writes are only seen "
                              "past the page cache)")
        fs = str(Path(path).parent)
        if fs not in _warned_buffered:
            _warned_buffered.add(fs)
            log.warning("%s: filesystem refuses O_DIRECT; using buffered IO with fdatasync", fs)
    return os.open(path, flags, 0o600), False


def _direct_read_works(fd: int) -> bool:
    if os.fstat(fd).st_size < ALIGN and stat.S_ISREG(os.fstat(fd).st_mode):
        return True  # nothing to read yet; the open itself was the test
    buf = AlignedBuffer(ALIGN)
    try:
        os.preadv(fd, [buf.view], 0)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        buf.close()


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically: write ``<name>.tmp``, fsync, rename over, fsync the directory.
    Every descriptor it opens is closed on every path; a failure leaves the old file (and maybe a stale tmp)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """fsync a directory: the entries created, renamed or removed in it are durable once this returns."""
    dfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def make_dir(path: Path) -> None:
    """``mkdir`` (0700) if missing, then fsync its parent, always: also where an earlier process that
    crashed made it without syncing. Crash rule: a directory the store relies on is durable before
    anything is written into it (a power cut would otherwise take its synced files with it)."""
    path.mkdir(mode=0o700, exist_ok=True)
    fsync_dir(path.parent)


def create_once(path: Path, data: bytes) -> None:
    """Make ``path`` hold ``data`` unless it exists already: ``data`` goes to a private tmp name (written,
    fsynced), which is hard-linked into place. A link never replaces a file, so of two processes making
    the same file at once exactly one wins and the other keeps the winner's (the caller reads ``path``).

    Crash rule: ``path`` appears complete or not at all; a crash leaves at most a stale ``.<name>.*.tmp``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return  # another process made it first: theirs is the one
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def check_header(found: dict[str, Any], want: dict[str, Any], where: str) -> None:
    version = found.get("format_version")
    if version != fmt.FORMAT_VERSION:
        ns_dir = str(Path(where).parent) if where.endswith("HEADER") else where
        raise StoreFormatError(
            f"{where}: store format {version}, this build reads format {fmt.FORMAT_VERSION}. Its pages are a "
            f"cache, recomputed on demand: remove them (rm -r {ns_dir}) and start again")
    if "parts" in want and found.get("parts") != want["parts"]:
        raise StoreFormatError(f"{where}: parts is {found.get('parts')!r} on disk but {want['parts']!r} here "
                               "(pages checksummed in other ranges: another page size or layer grouping?)")
    for field in ("namespace", "slot_bytes", "device_index", "device_count", "store_id"):
        if found.get(field) != want.get(field):
            raise StoreFormatError(
                f"{where}: {field} is {found.get(field)!r} on disk but {want.get(field)!r} here "
                "(devices reordered, added or removed, or another store?)")


class Arena:
    """One device's share of one namespace shard: ``capacity_slots`` slots of ``slot_bytes``."""

    path: str
    capacity_slots: int
    direct: bool

    def locate(self, local_slot: int) -> tuple[int, int]:
        """(fd, byte offset) of a slot, creating backing storage if needed (may raise OSError ENOSPC)."""
        raise NotImplementedError

    def fds(self) -> list[int]:
        """The open file descriptors behind the arena's slots."""
        raise NotImplementedError

    def segment_of(self, local_slot: int) -> int:
        """Which of the arena's files holds ``local_slot`` (0 where one file holds them all)."""
        return 0

    def prepare(self) -> None:
        """A writer's arena, once the writer's journal exists: make ready what its first puts need (an arena
        of segment files starts making its first one in the background). Nothing by default."""

    def settle(self) -> None:
        """Return once no background work of the arena (a segment being made ahead) is in flight."""

    def reopen(self, local_slot: int) -> bool:
        """Open the file holding ``local_slot`` afresh, in place of the descriptor open on it now (same
        number: ops built or in flight on it stay valid; ``store.renewal``). False where the arena cannot
        (this one), or that file is not open; raises OSError where opening it again fails."""
        return False

    def punch_free(self, local_slots: list[int]) -> int:
        """Give the space of these free local slots back to the filesystem (``holes.punch``, one call per run
        of consecutive slots in one segment); how many bytes were punched. The caller guarantees they are
        free and pinned by no reader. Never raises. A raw block device punches nothing (returns 0): a
        BLKDISCARD would be possible but is not done."""
        return 0

    def close(self) -> None:
        """Close every file of the arena."""
        raise NotImplementedError


class DirectoryArena(Arena):
    """An arena on a mounted filesystem: ``ns-<digest>/HEADER`` and one writer's preallocated
    ``ns-<digest>/w-<wid>/seg-NNNNN.dat`` files."""

    def __init__(self, root: str, nsdir: str, wdir: str, header: dict[str, Any], slot_bytes: int,
                 segment_bytes: int, capacity_slots: int | None, shard_count: int, direct: str, create: bool):
        self.path = root
        self.ns_dir = Path(root) / nsdir
        self.dir = self.ns_dir / wdir
        self.slot_bytes = slot_bytes
        self.writable = create
        self._fds: dict[int, int] = {}
        self._fds_lock = threading.Lock()  # ``reopen`` against ``close``: never a dup2 onto a closed number
        self._grow_lock = threading.Lock()  # one creation of a segment at a time: the put path's or the ahead's
        self._ahead: SegmentAhead | None = None  # a writer's maker of segments ahead of need (``prepare``)
        if not Path(root).is_dir():
            raise DeviceError(f"{root}: not a directory")
        if create:
            try:
                make_dir(self.ns_dir)
                make_dir(self.dir)
            except OSError as exc:
                raise DeviceError(f"{root}: cannot create {self.dir.relative_to(root)}: {exc.strerror}") from None
            if not os.access(self.dir, os.W_OK):
                raise DeviceError(f"{root}: not writable")
        header_path = self.ns_dir / "HEADER"
        if not header_path.exists():
            if not create:
                raise DeviceError(f"{self.ns_dir}: no store here")
            create_once(header_path, fmt.pack_header(fmt.HEADER_MAGIC, header))
        try:
            found = fmt.unpack_header(fmt.HEADER_MAGIC, header_path.read_bytes(), str(header_path))
        except CorruptRecordError as exc:
            raise StoreFormatError(str(exc)) from None
        check_header(found, header, str(header_path))
        # Probe once per device so every segment, present or future, is opened the same way.
        probe_fd, self.direct = open_file(str(header_path), os.O_RDONLY, direct)
        os.close(probe_fd)
        self._direct_mode = (DIRECT_CLUSTER if direct == DIRECT_CLUSTER else "on") if self.direct else "off"
        existing = sorted(self.dir.glob("seg-*.dat"))
        self.slots_per_segment = max(1, segment_bytes // slot_bytes)
        self._ahead_from = self.slots_per_segment // 2  # a slot this far into the last segment: make the next
        used = sum(p.stat().st_size for p in existing)
        fs = os.statvfs(root)
        free = fs.f_bavail * fs.f_frsize
        sized = fs.f_blocks > 0  # ramfs and some FUSE filesystems report no size at all: nothing to check
        if capacity_slots is None:
            if not sized:
                raise DeviceError(f"{root}: the filesystem reports no size; set capacity_bytes")
            capacity_slots = int((free + used) * 0.9) // slot_bytes // shard_count
        self.capacity_slots = capacity_slots
        need = min(capacity_slots, self.slots_per_segment) * slot_bytes
        if create and (capacity_slots < 1 or (sized and free + used < need)):
            raise DeviceError(f"{root}: too small: {free + used} bytes free, need at least {need} "
                              f"(one segment of {self.slots_per_segment} slots of {slot_bytes} bytes)")
        try:
            for seg_path in existing:
                self._open_segment(int(seg_path.stem.split("-")[1]), create=False)
        except BaseException as exc:
            abandon(exc, root, [("segment files", self.close)])  # the segments opened before this one
            raise

    def _segment_path(self, seg: int) -> Path:
        return self.dir / f"seg-{seg:05d}.dat"

    def _open_segment(self, seg: int, create: bool) -> int:
        path = self._segment_path(seg)
        flags = (os.O_RDWR | (os.O_CREAT if create else 0)) if self.writable else os.O_RDONLY
        fd, _ = open_file(str(path), flags, self._direct_mode)
        if create:
            size = min(self.slots_per_segment, self.capacity_slots - seg * self.slots_per_segment) * self.slot_bytes
            try:
                os.posix_fallocate(fd, 0, size)
                # Crash rule: the segment's name is durable before any page in it is acknowledged; an
                # fdatasync of its data alone would not bring back its directory entry after a power cut.
                # Its descriptor is published (``_fds``) only after this, so no page is written into it before.
                fsync_dir(self.dir)
            except OSError:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
        with self._fds_lock:
            self._fds[seg] = fd
        return fd

    def _make_segment(self, seg: int) -> int:
        """Segment ``seg``'s descriptor, creating the file unless it is open already (a writer's)."""
        with self._grow_lock:
            fd = self._fds.get(seg)
            if fd is not None:
                return fd
            failed = None if self._ahead is None else self._ahead.failure(seg)
            if failed is not None:  # made ahead and failed (ENOSPC...): this put's "cannot grow"; the next retries
                raise failed
            return self._open_segment(seg, create=True)

    def _segments_end(self) -> int:
        """How many segments the arena's capacity spans."""
        return -(-self.capacity_slots // self.slots_per_segment)

    def prepare(self) -> None:
        """A writer's arena, once its journal exists: make its first segment not yet there, in the background
        (a put that gets there first waits for it, or makes it). Readers: nothing."""
        if not self.writable or self._ahead is not None:
            return
        # Crash rule: called after the writer's journal is made, so a crash leaving this (empty) segment
        # behind never leaves segments without a journal (``layout.check_meta_present`` refuses those).
        self._ahead = SegmentAhead(weak_method(self._make_segment, -1), str(self.dir))  # no cycle
        first = next((s for s in range(self._segments_end()) if s not in self._fds), None)
        if first is not None:
            self._ahead.start(first)

    def settle(self) -> None:
        if self._ahead is not None:
            self._ahead.wait()

    def locate(self, local_slot: int) -> tuple[int, int]:
        seg, index = divmod(local_slot, self.slots_per_segment)
        fd = self._fds.get(seg)
        if fd is None:
            # A writer makes it (or waits for it being made ahead); a reader opens a segment its writer made
            # since (OSError ENOENT if there is none).
            fd = self._make_segment(seg) if self.writable else self._open_segment(seg, create=False)
        ahead = self._ahead
        if (ahead is not None and index >= self._ahead_from and seg + 1 not in self._fds
                and seg + 1 < self._segments_end()):
            ahead.start(seg + 1)  # the upper part of this segment is in use: the next one is made meanwhile
        return fd, index * self.slot_bytes

    def fds(self) -> list[int]:
        return list(self._fds.values())

    def segment_of(self, local_slot: int) -> int:
        return local_slot // self.slots_per_segment

    def reopen(self, local_slot: int) -> bool:
        seg = self.segment_of(local_slot)
        with self._fds_lock:
            fd = self._fds.get(seg)
            if fd is None:
                return False  # not open: the next ``locate`` opens it afresh anyway
            flags = os.O_RDWR if self.writable else os.O_RDONLY
            new, _ = open_file(str(self._segment_path(seg)), flags, self._direct_mode)
            try:
                os.dup2(new, fd, inheritable=False)
            finally:
                os.close(new)
        return True

    def punch_free(self, local_slots: list[int]) -> int:
        done = 0
        per_seg = self.slots_per_segment
        for first, count in holes.runs(local_slots):
            slot = first
            while slot < first + count:  # a run may cross a segment boundary: one punch per segment
                seg, index = divmod(slot, per_seg)
                n = min(first + count - slot, per_seg - index)
                fd = self._fds.get(seg)  # a segment never made holds no blocks to free
                if fd is not None and self.writable and holes.punch(fd, index * self.slot_bytes, n * self.slot_bytes):
                    done += n * self.slot_bytes
                slot += n
        return done

    def close(self) -> None:
        """Join the making of a segment in flight, then close every segment file, each whatever the others
        raise (then the first error). Idempotent."""
        if self._ahead is not None:
            self._ahead.close()  # its segment, if made, is in ``_fds`` now: closed below
        with self._fds_lock:
            fds, self._fds = list(self._fds.values()), {}  # detached first: a failed close is never retried
        release_all((f"segment fd {fd}", partial(os.close, fd)) for fd in fds)


def is_block_like(path: str) -> bool:
    """A raw arena: a block device, or an existing regular file standing in for one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DeviceError(f"devices: {path} does not exist") from None
    return stat.S_ISBLK(mode) or stat.S_ISREG(mode)
