"""A writer's meta, as what a writer needs of it: where its journal generations, checkpoint, lease and config
go, and how they are read back. Also the ``LEASE`` name and its blocks (``FileBlocks``) and ``save_config``.

Two kinds (``writer_meta`` picks the layout's):
  * ``DirMeta``: a writer directory ``w-<wid>/`` (``store.format``): ``journal_write.Journal`` files, the
    checkpoint replaced by tmp + rename (``journal_write.replace_checkpoint``, which deletes the journals
    it covers), ``LEASE`` / ``CONFIG`` files; read back with plain syscalls (``io.file_view.POSIX``).
  * ``media.shared_raw.region_meta.RegionFiles``: a writer's region of a shared raw pool (its areas on the
    device, O_DIRECT); it is its own ``view``.
A writer writes its meta only through one (``open_journal``, ``may_rotate``, ``write_checkpoint``,
``lease_blocks``, ``save_config``) and recovers through its ``view``; readers of other writers read through
the same views, so ``store.journal`` never knows which kind it reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgpack

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.io.file_view import POSIX, FileView
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import journal_write as jw
from sgl_kvtier.store.devices import write_file_atomic

LEASE = "LEASE"  # a writer's lease file (``store.format``; beaten by ``sharing.lease``)


class LeaseBlocks(Protocol):
    """Where a lease's two blocks go: ``write_block`` is durable when it returns."""

    def write_block(self, index: int, data: bytes) -> None: ...
    def close(self) -> None: ...


class FileBlocks:
    """A ``LEASE`` file's blocks (created 0600 where absent): pwrite + fdatasync."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def write_block(self, index: int, data: bytes) -> None:
        os.pwrite(self.fd, data, index * fmt.LEASE_BLOCK_BYTES)
        os.fdatasync(self.fd)

    def close(self) -> None:
        fd, self.fd = self.fd, -1  # detached first: closed once
        if fd >= 0:
            os.close(fd)


class WriterJournal(Protocol):
    """One journal generation a writer appends to (``journal_write.Journal``,
    ``media.shared_raw.region_meta.AreaJournal``)."""

    generation: int
    path: Path
    records: int
    size: int
    synced: int

    @property
    def nearly_full(self) -> bool: ...  # a checkpoint is due (a bounded journal past half full)
    def room(self) -> int | None: ...  # bytes it may still grow by (None: no bound)
    def append(self, records: list[bytes]) -> None: ...
    def sync(self) -> None: ...
    def close(self) -> None: ...


class WriterMeta(Protocol):
    """A writer's meta: a directory or a shared raw region's areas (see the module docstring)."""

    path: Path

    @property
    def view(self) -> FileView: ...
    def open_journal(self, generation: int) -> WriterJournal: ...
    def may_rotate(self, generation: int) -> bool: ...
    def write_checkpoint(self, blob: bytes, generation: int) -> None: ...
    def lease_blocks(self, host_beat: Callable[[], bool] | None = None) -> LeaseBlocks: ...
    def save_config(self, config: StoreConfig) -> None: ...
    def close(self) -> None: ...


class DirMeta:
    """A writer directory on a filesystem (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = path

    @property
    def view(self) -> FileView:
        return POSIX

    def open_journal(self, generation: int) -> WriterJournal:
        return jw.Journal(self.path, generation)

    def may_rotate(self, generation: int) -> bool:
        return True  # a new file each generation

    def write_checkpoint(self, blob: bytes, generation: int) -> None:
        jw.replace_checkpoint(self.path, blob, generation)

    def lease_blocks(self, host_beat: Callable[[], bool] | None = None) -> LeaseBlocks:
        return FileBlocks(self.path / LEASE)

    def save_config(self, config: StoreConfig) -> None:
        save_config(self.path, config)

    def close(self) -> None:
        pass  # holds no descriptor


def save_config(meta: Path, config: StoreConfig) -> None:
    """Record the config a writer used, so offline tools (inspect, fsck) see the same devices and limits."""
    write_file_atomic(meta / "CONFIG", msgpack.packb(config.to_mapping()))


def writer_meta(files: WriterMeta | None, meta: Path) -> WriterMeta:
    """A writer's meta: ``files`` (a shared raw region's areas, ``Layout.files``) if any, else its directory."""
    return files if files is not None else DirMeta(meta)
