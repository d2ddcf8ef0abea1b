"""How a follower reads another writer's files: ``FileView`` (the protocol) and ``POSIX`` (plain syscalls).

A follower (``sharing.follower.PageReader``, ``store.journal``'s replay) reads a writer's journals,
checkpoint and lease only through a view, so tests can interpose a stale one (``io.stale.StaleFiles``).
Every ``POSIX`` read opens the file afresh: on NFS, close-to-open consistency then gives fresh attributes
and data.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol


class FileView(Protocol):
    """A writer's files as a follower sees them: ``read`` (bytes from ``offset`` to the end, at most ``limit``)
    and ``size`` raise FileNotFoundError; ``listdir`` of a missing directory is []."""

    def read(self, path: Path, offset: int = 0, limit: int | None = None) -> bytes: ...
    def size(self, path: Path) -> int: ...
    def exists(self, path: Path) -> bool: ...
    def listdir(self, path: Path) -> list[str]: ...


class PosixView:
    """Plain syscalls; every read opens the file afresh (on NFS: fresh attributes and data)."""

    def read(self, path: Path, offset: int = 0, limit: int | None = None) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            end = os.fstat(fd).st_size if limit is None else offset + limit
            chunks, at = [], offset
            while at < end:
                chunk = os.pread(fd, end - at, at)
                if not chunk:
                    break
                chunks.append(chunk)
                at += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def size(self, path: Path) -> int:
        return path.stat().st_size

    def exists(self, path: Path) -> bool:
        return path.exists()

    def listdir(self, path: Path) -> list[str]:
        try:
            return os.listdir(path)
        except OSError:  # not there, not a directory, not readable: none listed (as ``Path.glob``)
            return []


POSIX = PosixView()
