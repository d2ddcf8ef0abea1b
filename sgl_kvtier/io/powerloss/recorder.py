"""The recorder of the power-loss fault mode: wraps the ``os`` file functions while installed and logs
every call under ``root`` (the model it feeds is in the package docstring, ``sgl_kvtier.io.powerloss``).

Every call goes to the real filesystem first; the ones on a path or descriptor under ``root`` are then
logged, all under one lock, so the log is one serial history the threads really produced (a sync covers
exactly the entries logged before it). Files are nodes (inodes): a descriptor names a node, a rename
moves an entry, never data. Files under ``root`` written around the wrappers (the ``open()`` builtin,
mmap) are adopted as they are on disk when first opened through ``os.open`` (``Recording.adopted``).
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sgl_kvtier.io.powerloss.state import CutPolicy, Entry, Recording, build, random_policy

_WRAPPED = ("open", "write", "writev", "pwrite", "pwritev", "ftruncate", "truncate", "posix_fallocate", "fsync",
            "fdatasync", "sync", "rename", "replace", "link", "unlink", "remove", "mkdir", "rmdir", "close")


@dataclasses.dataclass
class _Fd:
    node: int
    direct: bool
    path: str


class Recorder:
    """Logs the file operations under ``root`` while installed (``with Recorder(root) as rec:``); see the
    package docstring. One recorder may be installed at a time in a process."""

    _active: Recorder | None = None

    def __init__(self, root: Path | str, *, direct_durable: bool = False):
        self.root = os.path.abspath(root)
        self.direct_durable = direct_durable
        self._lock = threading.RLock()
        self._real: dict[str, Callable[..., Any]] = {}
        self._fds: dict[int, _Fd] = {}
        self._live: dict[str, int] = {}  # path -> node, as the filesystem shows it now
        self._dirs: set[int] = set()
        self._next = 0
        self.recording = Recording(self.root)

    # ------------------------------------------------------------------ install
    def __enter__(self) -> Recorder:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def install(self) -> None:
        """Snapshot ``root`` (its files' bytes are the durable start) and wrap the ``os`` functions."""
        if Recorder._active is not None:
            raise RuntimeError("a power-loss Recorder is already installed in this process")
        self._snapshot()
        for name in _WRAPPED:
            self._real[name] = getattr(os, name)
            setattr(os, name, getattr(self, "_" + name))
        Recorder._active = self

    def uninstall(self) -> None:
        """Put the real ``os`` functions back (idempotent)."""
        for name, fn in self._real.items():
            setattr(os, name, fn)
        self._real.clear()
        if Recorder._active is self:
            Recorder._active = None

    def mark(self, label: str, payload: Any = None) -> int:
        """Log a workload marker; returns its log position."""
        return self._log(Entry("mark", label=label, payload=payload))

    def zeroed(self, fd: int, offset: int, length: int) -> None:
        """Log that ``length`` bytes at ``offset`` of ``fd``'s file now read as zeros (a hole punched around
        the wrappers, e.g. through libc's ``fallocate``): a write of zeros, durable with the file's sync."""
        with self._lock:
            if fd in self._fds and length > 0:
                self._data(fd, Entry("write", offset=offset, data=bytes(length)))

    def _snapshot(self) -> None:
        rec = self.recording
        rec.root_node = self._node(self.root, is_dir=True)
        for dirpath, dirnames, filenames in os.walk(self.root):
            parent = self._live[dirpath]
            for name in sorted(dirnames):
                node = self._node(os.path.join(dirpath, name), is_dir=True)
                rec.initial_entries.setdefault(parent, {})[name] = node
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                node = self._node(path, is_dir=False)
                rec.initial_entries.setdefault(parent, {})[name] = node
                with open(path, "rb") as f:
                    rec.initial_data[node] = f.read()

    def _node(self, path: str, is_dir: bool) -> int:
        node, self._next = self._next, self._next + 1
        self._live[path] = node
        if is_dir:
            self._dirs.add(node)
            self.recording.dirs.add(node)
        return node

    def _log(self, entry: Entry) -> int:
        with self._lock:
            self.recording.entries.append(entry)
            return len(self.recording.entries) - 1

    # ------------------------------------------------------------------ paths
    def _path(self, p: Any) -> str | None:
        """The absolute path of ``p`` if it is under ``root``, else None."""
        if isinstance(p, int):
            return None
        path = os.path.abspath(os.fsdecode(p))
        return path if path == self.root or path.startswith(self.root + os.sep) else None

    def _split(self, path: str) -> tuple[int, str] | None:
        parent = self._live.get(os.path.dirname(path))
        return None if parent is None else (parent, os.path.basename(path))

    def _adopt(self, path: str) -> int:
        """A path under root that the log never saw made: taken as durable, as it is on disk now."""
        where = self._split(path)
        node = self._node(path, is_dir=os.path.isdir(path))
        if where is not None:
            self.recording.initial_entries.setdefault(where[0], {})[where[1]] = node
        if node not in self._dirs:
            with open(path, "rb") as f:
                self.recording.initial_data[node] = f.read()
        self.recording.adopted += 1
        return node

    def _forget_below(self, path: str) -> None:
        for p in [p for p in self._live if p == path or p.startswith(path + os.sep)]:
            del self._live[p]

    # ------------------------------------------------------------------ wrappers
    def _open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        with self._lock:
            where = self._path(path) if dir_fd is None else None
            existed = where is not None and where in self._live
            fd: int = self._real["open"](path, flags, mode, dir_fd=dir_fd)
            self._fds.pop(fd, None)
            if where is None:
                return fd
            if existed:
                node = self._live[where]
            elif flags & os.O_CREAT and (split := self._split(where)) is not None:
                node = self._node(where, is_dir=False)
                self.recording.initial_data.setdefault(node, b"")
                self._log(Entry("add", node=node, parent=split[0], name=split[1], path=where))
            else:
                node = self._adopt(where)
            if flags & os.O_TRUNC:
                self._log(Entry("trunc", node=node, size=0, path=where))
            self._fds[fd] = _Fd(node, bool(flags & getattr(os, "O_DIRECT", 0)), where)
            return fd

    def _data(self, fd: int, entry: Entry) -> None:
        f = self._fds[fd]
        entry.node, entry.path = f.node, f.path
        entry.durable = f.direct and self.direct_durable and entry.kind == "write"
        self._log(entry)

    def _write(self, fd: int, data: Any) -> int:
        with self._lock:
            n: int = self._real["write"](fd, data)
            if fd in self._fds and n > 0:
                end = os.lseek(fd, 0, os.SEEK_CUR)  # O_APPEND or not, the position is just past the bytes
                self._data(fd, Entry("write", offset=end - n, data=bytes(memoryview(data).cast("B")[:n])))
            return n

    def _writev(self, fd: int, buffers: Any) -> int:
        with self._lock:
            n: int = self._real["writev"](fd, buffers)
            if fd in self._fds and n > 0:
                end = os.lseek(fd, 0, os.SEEK_CUR)
                self._data(fd, Entry("write", offset=end - n, data=_joined(buffers, n)))
            return n

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        with self._lock:
            n: int = self._real["pwrite"](fd, data, offset)
            if fd in self._fds and n > 0:
                self._data(fd, Entry("write", offset=offset, data=bytes(memoryview(data).cast("B")[:n])))
            return n

    def _pwritev(self, fd: int, buffers: Any, offset: int, *flags: int) -> int:
        with self._lock:
            n: int = self._real["pwritev"](fd, buffers, offset, *flags)
            if fd in self._fds and n > 0:
                self._data(fd, Entry("write", offset=offset, data=_joined(buffers, n)))
            return n

    def _ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            self._real["ftruncate"](fd, length)
            if fd in self._fds:
                self._data(fd, Entry("trunc", size=length))

    def _truncate(self, path: Any, length: int) -> None:
        with self._lock:
            if isinstance(path, int):
                return self._ftruncate(path, length)
            self._real["truncate"](path, length)
            where = self._path(path)
            if where is not None:
                node = self._live.get(where)
                self._log(Entry("trunc", node=self._adopt(where) if node is None else node, size=length, path=where))
            return None

    def _posix_fallocate(self, fd: int, offset: int, length: int) -> None:
        with self._lock:
            self._real["posix_fallocate"](fd, offset, length)
            if fd in self._fds:
                self._data(fd, Entry("alloc", size=offset + length))

    def _fsync(self, fd: Any) -> None:
        self._sync_fd("fsync", fd)

    def _fdatasync(self, fd: Any) -> None:
        self._sync_fd("fdatasync", fd)

    def _sync_fd(self, name: str, fd: Any) -> None:
        with self._lock:
            self._real[name](fd)
            num = fd if isinstance(fd, int) else fd.fileno()
            if num in self._fds:
                f = self._fds[num]
                self._log(Entry("sync", node=f.node, name=name, is_dir=f.node in self._dirs, path=f.path))

    def _sync(self) -> None:
        with self._lock:
            self._real["sync"]()
            self._log(Entry("syncall"))

    def _mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        with self._lock:
            self._real["mkdir"](path, mode, dir_fd=dir_fd)
            where = self._path(path) if dir_fd is None else None
            if where is not None and (split := self._split(where)) is not None:
                node = self._node(where, is_dir=True)
                self._log(Entry("add", node=node, parent=split[0], name=split[1], path=where))

    def _remove_entry(self, real: str, path: Any, dir_fd: int | None) -> None:
        with self._lock:
            self._real[real](path, dir_fd=dir_fd)
            where = self._path(path) if dir_fd is None else None
            if where is not None and (split := self._split(where)) is not None:
                self._forget_below(where)
                self._log(Entry("del", parent=split[0], name=split[1], path=where))

    def _unlink(self, path: Any, *, dir_fd: int | None = None) -> None:
        self._remove_entry("unlink", path, dir_fd)

    def _remove(self, path: Any, *, dir_fd: int | None = None) -> None:
        self._remove_entry("remove", path, dir_fd)

    def _rmdir(self, path: Any, *, dir_fd: int | None = None) -> None:
        self._remove_entry("rmdir", path, dir_fd)

    def _link(self, src: Any, dst: Any, **kw: Any) -> None:
        with self._lock:
            self._real["link"](src, dst, **kw)
            s, d = self._path(src), self._path(dst)
            if s is not None and d is not None and (split := self._split(d)) is not None:
                node = self._live[s] if s in self._live else self._adopt(s)
                self._live[d] = node
                self._log(Entry("add", node=node, parent=split[0], name=split[1], path=d))

    def _rename(self, src: Any, dst: Any, **kw: Any) -> None:
        self._move("rename", src, dst, kw)

    def _replace(self, src: Any, dst: Any, **kw: Any) -> None:
        self._move("replace", src, dst, kw)

    def _move(self, real: str, src: Any, dst: Any, kw: dict[str, Any]) -> None:
        with self._lock:
            self._real[real](src, dst, **kw)
            s, d = self._path(src), self._path(dst)
            if s is None or d is None:
                return
            node = self._live[s] if s in self._live else self._adopt(s)
            moved = {p[len(s):]: n for p, n in self._live.items() if p == s or p.startswith(s + os.sep)}
            self._forget_below(s)
            self._forget_below(d)
            for rest, n in moved.items():
                self._live[d + rest] = n
            ss, ds = self._split_parent(s), self._split_parent(d)
            if ss[0] == ds[0]:
                self._log(Entry("move", node=node, parent=ds[0], name=ds[1], old=ss[1], path=d))
            else:
                self._log(Entry("add", node=node, parent=ds[0], name=ds[1], path=d))
                self._log(Entry("del", parent=ss[0], name=ss[1], path=s))

    def _split_parent(self, path: str) -> tuple[int, str]:
        parent = os.path.dirname(path)
        node = self._live[parent] if parent in self._live else self._adopt(parent)
        return node, os.path.basename(path)

    def _close(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
            self._real["close"](fd)


def _joined(buffers: Any, n: int) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:n]


def cut_states(recording: Recording, cuts: list[int], seed: int,
               policy: CutPolicy | None = None) -> Iterator[tuple[int, CutPolicy, dict[str, bytes | None]]]:
    """For each cut, the policy used (``policy`` or a random one) and the built tree (``build``)."""
    rng = random.Random(seed)
    for cut in cuts:
        chosen = policy or random_policy(rng)
        yield cut, chosen, build(recording, cut, chosen, rng)
