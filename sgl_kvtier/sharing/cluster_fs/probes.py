"""The probes of ``sgl-kvtier check-shared``: is a directory fit for ``sharing = "cluster"``?

``check_shared`` reports the filesystem (``sharing.cluster_fs.detect``: its class, read-only mounts) and tries, each
on a private file it removes again: O_DIRECT write + read back (``probe_direct_io``, also an open rule of
``sharing.cluster_fs.check``), create-once (O_EXCL + hard link: a link never replaces a file), rename over a file,
fsync of a file and of the directory. With ``--peer-wait`` it runs ``cross_host.exchange`` with another host
running it at once: two hosts that see each other's probes see one directory, and each reports what it saw
of the other's files (lock scope, a descriptor held across the other's overwrite, a fresh open, a rename
over a name: ``cross_probes``; only a fresh open missing the overwrite is a problem, the store adapts to the
rest). A probe that fails is a problem of the report (``SharedCheck.problems``), never an
exception.
"""

from __future__ import annotations

import errno
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sgl_kvtier.errors import DeviceError
from sgl_kvtier.io.buffers import ALIGN, AlignedBuffer
from sgl_kvtier.sharing.cluster_fs.cross_host import (
    CATCH_UP_S,
    CrossHost,
    LockScope,
    exchange,
)
from sgl_kvtier.sharing.cluster_fs.detect import FsClass, FsInfo, detect, local_fs_refusal
from sgl_kvtier.sharing.writers import boot_id, machine_id
from sgl_kvtier.store.devices import create_once, fsync_dir, write_file_atomic


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
    cross: CrossHost | None = None  # what this host saw of the peer's files (``cross_host``), with a peer

    @property
    def fit(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fs"]["fs_class"] = self.fs.fs_class.value
        out["cross"] = None if self.cross is None else self.cross.to_dict()
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


def check_shared(directory: str | Path, *, peer_wait_s: float | None = None, mountinfo: str | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> SharedCheck:
    """Probe ``directory`` for cluster mode: the filesystem and its class, O_DIRECT, create-once (O_EXCL +
    hard link), rename over a file, fsync of a file and the directory; with ``peer_wait_s``, the exchange
    with another host (``cross_host.exchange``). Raises DeviceError when ``directory`` is not a directory."""
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
    probes: tuple[Probe, ...] = (_probe("O_DIRECT", lambda: probe_direct_io(path)),
              _probe("create-once (O_EXCL + hard link)", lambda: _probe_create_once(path)),
              _probe("rename over a file", lambda: _probe_rename(path)),
              _probe("fsync (file and directory)", lambda: _probe_fsync(path)))
    problems += [f"{p.name}: {p.detail}" for p in probes if not p.ok]
    peer, cross = None, None
    if peer_wait_s is not None:
        try:
            peer, cross = exchange(path, peer_wait_s, _identity(), sleep=sleep)
        except OSError as exc:
            problems.append(f"peer probe: {exc.strerror}")
        else:
            if peer is None:
                problems.append(f"no other host's probe appeared in {peer_wait_s:g} s (run this on another host "
                                "at the same time; if it runs, the two do not see one filesystem here)")
            elif cross is None:
                notes.append(f"{peer.get('host')} was seen, but the exchange of files with it did not finish in "
                             f"{peer_wait_s:g} s: lock scope, descriptors and renames across hosts not measured")
            else:
                seen = cross_probes(cross)
                probes += seen
                problems += [f"{p.name}: {p.detail}" for p in seen if not p.ok]
                notes += cross_notes(cross)
    return SharedCheck(str(directory), info, probes, tuple(problems), tuple(notes), peer, cross)


def cross_probes(cross: CrossHost) -> tuple[Probe, ...]:
    """The report's lines for what this host saw of the other host's files (``cross_host``). Only a fresh
    open missing the other's overwrite is a problem: the store adapts to the rest."""
    if cross.descriptor_stale_s is None:
        held = "reads the new bytes at once"
    elif cross.descriptor_stale_s >= CATCH_UP_S:
        held = f"keeps returning the old bytes (over {CATCH_UP_S:g} s)"
    else:
        held = f"returned the old bytes for {cross.descriptor_stale_s:.1f} s"
    if cross.rename_visible_s is None:
        renamed = f"the new file did not show within {CATCH_UP_S:g} s"
    else:
        renamed = (f"{'ENOENT, then ' if cross.rename_missing else ''}the new file after "
                   f"{cross.rename_visible_s:.1f} s")
    return (Probe("lock scope (seen from another host)", True,
                  "cluster-wide: a flock held on one host blocks the other" if cross.lock_scope is LockScope.CLUSTER_WIDE
                  else "host-local: a flock held on one host does not block the other"),
            Probe("a descriptor held across another host's overwrite in place", True, held),
            Probe("a fresh open after another host's overwrite in place", cross.fresh_open_sees,
                  "reads the new bytes" if cross.fresh_open_sees else
                  f"still read the old bytes after {CATCH_UP_S:g} s: the hosts do not see each other's writes here"),
            Probe("a rename over a name on another host", True, renamed))


def cross_notes(cross: CrossHost) -> list[str]:
    """How the store copes with what ``cross_probes`` reports."""
    notes = []
    if cross.descriptor_stale_s is not None:
        notes.append("descriptors opened before another host rewrote a range keep old bytes here: followers read "
                     "a page that fails verification again through a fresh descriptor (store.renewal)")
    if cross.rename_missing or cross.rename_visible_s is None:
        notes.append("a file renamed over a name on one host is briefly missing on another here: followers retry "
                     "a checkpoint they cannot read at the next announcement")
    return notes
