"""A FUSE mount whose client died, then mounted again, emulated inside one process (a test helper).

What a killed JuiceFS client does to the processes using its mount (tests/sharing/test_fs_lab_faults.py does
it for real): every descriptor open on the mount answers ENOTCONN from then on, and every path under it too,
until the filesystem is mounted again at the same path; then paths and fresh opens work, while the old
descriptors stay ENOTCONN for good. ``DeadMount(root, monkeypatch)``:
  * ``kill()``: the descriptors of files under ``root`` open now are dead (marked on their open file
    description, ``O_NONBLOCK``, which regular files ignore: a fresh open ``dup2``'ed over the same number
    is not marked); paths under ``root`` answer ENOTCONN.
  * ``remount()``: paths work again; the dead descriptors stay dead.
The ``os`` calls the store makes are patched for the test (``monkeypatch``): reads, writes and syncs through
a dead descriptor, ``fstat`` of one, and opens, stats, listings and directory changes of a path while the
mount is down. Counts: ``refused`` (calls answered ENOTCONN).
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

FD_CALLS = ("read", "write", "pread", "pwrite", "preadv", "pwritev", "fsync", "fdatasync", "fstat")
PATH_CALLS = ("open", "stat", "lstat", "listdir", "scandir", "mkdir", "rmdir", "unlink", "rename", "replace", "link")


class DeadMount:
    """The mount at ``root`` as its client dies and is mounted again (module docstring)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.root = os.path.realpath(root)
        self.down = False
        self.refused = 0
        for name in FD_CALLS:
            monkeypatch.setattr(os, name, self._fd_call(getattr(os, name)))
        for name in PATH_CALLS:
            monkeypatch.setattr(os, name, self._path_call(getattr(os, name)))

    def kill(self) -> int:
        """The client dies: descriptors under ``root`` open now are dead, paths answer ENOTCONN; how many died."""
        dead = 0
        for fd in _open_fds():
            if self._under(fd):
                flags = fcntl.fcntl(fd, fcntl.F_GETFL)
                fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
                dead += 1
        self.down = True
        return dead

    def remount(self) -> None:
        """The filesystem is mounted again: paths and fresh opens work; dead descriptors stay dead."""
        self.down = False

    def _under(self, fd: int) -> bool:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return False
        return target == self.root or target.startswith(self.root + os.sep)

    def _dead(self, fd: object) -> bool:
        if not isinstance(fd, int):
            return False
        try:
            marked = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
        except OSError:
            return False
        return bool(marked) and self._under(fd)

    def _refuse(self, what: object) -> OSError:
        self.refused += 1
        return OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN), str(what))

    def _fd_call(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(fd: Any, *args: Any, **kwargs: Any) -> Any:
            if self._dead(fd):
                raise self._refuse(fd)
            return real(fd, *args, **kwargs)
        return call

    def _path_call(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(path, int):
                if self._dead(path):
                    raise self._refuse(path)
            elif self.down and self._path_under(path, *args):
                raise self._refuse(path)
            return real(path, *args, **kwargs)
        return call

    def _path_under(self, *paths: Any) -> bool:
        for p in paths:
            if isinstance(p, str | bytes | os.PathLike):
                full = os.path.abspath(os.fsdecode(p))
                if full == self.root or full.startswith(self.root + os.sep):
                    return True
        return False


def _open_fds() -> list[int]:
    return [int(name) for name in os.listdir("/proc/self/fd")]
