"""Seeded NFS-like incoherence for the tests of ``sharing = "cluster"`` followers (never for production).

``StaleFiles(inner, ...)`` wraps an ``io.file_view.FileView`` (give it to ``PageReader.open(view=...)``, or to a
block of followers with ``sharing.follower.reading_through``). Faults:
    lag_rate     a read of a ``lag_match`` file (journals) returns a random prefix past ``offset``; with
                 probability ``zero_share`` the missing bytes read as zeros instead (grown, not yet written)
    hide_s       a ``hide_match`` path is invisible for ``hide_s`` seconds after this view first saw it (a
                 cached negative dentry), and so are the files under a hidden directory
    stale_rate   a whole read of a ``stale_match`` file (``LEASE``) returns its content before the last
                 change this view saw
``clear()`` turns every fault off; ``injected`` counts each fault served.

``StaleSlotEngine(inner)`` wraps an IO engine: a read at a (file, offset) with an old version on record
(``remember``, or ``capture`` before the writer rewrites it) returns those bytes with their digests (a stale
data cache) until ``forget()``; ``served`` counts them.

``StaleDescriptorEngine(inner)`` wraps an IO engine the way JuiceFS over FUSE behaves across hosts: after
``hold(path)``, a read through a descriptor of ``path`` open at that moment returns the file's bytes as they
were then (past their end: the file's, an append is seen), however the file changes; a descriptor opened
afterwards (also one ``dup2``'ed over an old number) reads the file. ``served`` counts the reads through old
descriptors; ``release()`` ends it.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from sgl_kvtier.io.ops import IOEngine, IOOp, IOResult, OpKind, op_length, read_digests, short_error


class Files(Protocol):
    """What ``StaleFiles`` wraps (and is): ``io.file_view.FileView``."""

    def read(self, path: Path, offset: int = 0, limit: int | None = None) -> bytes: ...
    def size(self, path: Path) -> int: ...
    def exists(self, path: Path) -> bool: ...
    def listdir(self, path: Path) -> list[str]: ...


def _matches(path: Path, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(path.name, p) for p in patterns)


class StaleFiles:
    """A file view that lags, hides and serves stale files (see the module docstring)."""

    def __init__(self, inner: Files, *, seed: int = 0, clock: Callable[[], float] = time.monotonic,
                 lag_rate: float = 0.0, zero_share: float = 0.5, lag_match: Sequence[str] = ("journal-*.log",),
                 hide_s: float = 0.0, hide_match: Sequence[str] = ("w-*", "journal-*.log"),
                 stale_rate: float = 0.0, stale_match: Sequence[str] = ("LEASE",)):
        self.inner = inner
        self.clock = clock
        self.lag_rate, self.zero_share, self.lag_match = lag_rate, zero_share, tuple(lag_match)
        self.hide_s, self.hide_match = hide_s, tuple(hide_match)
        self.stale_rate, self.stale_match = stale_rate, tuple(stale_match)
        self.injected = {"lag": 0, "zeros": 0, "hidden": 0, "stale": 0}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._first_seen: dict[Path, float] = {}
        self._versions: dict[Path, tuple[bytes | None, bytes]] = {}  # path -> (before the last change, last)

    def clear(self) -> None:
        """No more faults: every file as it is, every path visible."""
        with self._lock:
            self.lag_rate = self.stale_rate = self.hide_s = 0.0

    def _hidden(self, path: Path) -> bool:
        return self._hidden_one(path) or self._hidden_one(path.parent)

    def _hidden_one(self, path: Path) -> bool:
        if self.hide_s <= 0 or not _matches(path, self.hide_match):
            return False
        now = self.clock()
        with self._lock:
            first = self._first_seen.get(path)
        if first is None:
            if not self.inner.exists(path):
                return False  # not there: nothing to hide (and its first sighting is still to come)
            with self._lock:
                first = self._first_seen.setdefault(path, now)
        if now < first + self.hide_s:
            with self._lock:
                self.injected["hidden"] += 1
            return True
        return False

    def read(self, path: Path, offset: int = 0, limit: int | None = None) -> bytes:
        if self._hidden(path):
            raise FileNotFoundError(errno.ENOENT, "not visible yet (injected negative lookup)", str(path))
        data = self.inner.read(path, offset, limit)
        with self._lock:
            if offset == 0 and _matches(path, self.stale_match):
                older, last = self._versions.get(path, (None, data))
                if data != last:
                    older, last = last, data
                self._versions[path] = (older, last)
                if older is not None and self._rng.random() < self.stale_rate:
                    self.injected["stale"] += 1
                    return older if limit is None else older[:limit]
            elif data and _matches(path, self.lag_match) and self._rng.random() < self.lag_rate:
                cut = self._rng.randrange(len(data))  # at least the last byte is not seen
                if self._rng.random() < self.zero_share:
                    self.injected["zeros"] += 1
                    return data[:cut] + bytes(len(data) - cut)
                self.injected["lag"] += 1
                return data[:cut]
        return data

    def size(self, path: Path) -> int:
        if self._hidden(path):
            raise FileNotFoundError(errno.ENOENT, "not visible yet (injected negative lookup)", str(path))
        return self.inner.size(path)

    def exists(self, path: Path) -> bool:
        return not self._hidden(path) and self.inner.exists(path)

    def listdir(self, path: Path) -> list[str]:
        if self._hidden(path):
            return []
        return [name for name in self.inner.listdir(path) if not self._hidden_one(path / name)]


class StaleSlotEngine:
    """An IO engine whose reads of remembered (file, offset) pairs return old bytes (see the module docstring)."""

    def __init__(self, inner: IOEngine):
        self.inner = inner
        self.name = f"stale({inner.name})"
        self.served = 0
        self._lock = threading.Lock()
        self._old: dict[tuple[int, int, int], bytes] = {}  # (st_dev, st_ino, offset) -> the old bytes

    def remember(self, path: str | Path, offset: int, data: bytes) -> None:
        """Reads at ``offset`` of the file ``path`` return ``data`` from now on (until ``forget``)."""
        st = os.stat(path)
        with self._lock:
            self._old[(st.st_dev, st.st_ino, offset)] = bytes(data)

    def capture(self, path: str | Path, offset: int, length: int) -> bytes:
        """``remember`` the ``length`` bytes at ``offset`` of ``path`` as they are now; returns them."""
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        self.remember(path, offset, data)
        return data

    def forget(self) -> None:
        """No more stale reads: every read reaches the file."""
        with self._lock:
            self._old.clear()

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        with self._lock:
            old = dict(self._old)
        if not old:
            return self.inner.run(ops)
        plan = [self._old_bytes(op, old) for op in ops]
        real = iter(self.inner.run([op for op, o in zip(ops, plan) if o is None]))
        return [next(real) if o is None else self._serve(op, o) for op, o in zip(ops, plan)]

    @staticmethod
    def _old_bytes(op: IOOp, old: dict[tuple[int, int, int], bytes]) -> bytes | None:
        if op.kind is not OpKind.READ:
            return None
        st = os.fstat(op.fd)
        return old.get((st.st_dev, st.st_ino, op.offset))

    def _serve(self, op: IOOp, data: bytes) -> IOResult:
        with self._lock:
            self.served += 1
        done = 0
        for buf in op.buffers:
            n = min(buf.nbytes, len(data) - done)
            if n <= 0:
                break
            buf[:n] = data[done:done + n]
            done += n
        if done < op_length(op):
            return IOResult(done, None, short_error(op, done), short=True)
        crc, parts = read_digests(op)
        return IOResult(done, crc, part_digests=parts)

    def close(self) -> None:
        """Close the wrapped engine."""
        self.inner.close()


class StaleDescriptorEngine:
    """An IO engine whose reads through descriptors opened before ``hold`` see old bytes (module docstring).

    A held descriptor is marked on its open file description (``O_NONBLOCK``, which regular files ignore),
    so the mark follows the description, not the number: a fresh open put in its place is unmarked."""

    def __init__(self, inner: IOEngine):
        self.inner = inner
        self.name = f"stale-fd({inner.name})"
        self.served = 0
        self._lock = threading.Lock()
        self._held: dict[tuple[int, int], tuple[str, bytes]] = {}  # (st_dev, st_ino) -> (path, bytes at hold)

    def hold(self, path: str | Path) -> int:
        """Descriptors of ``path`` open in this process now, read-only ones, see its bytes as they are now
        from here on; how many were marked. A second ``hold`` takes the bytes anew for every marked one."""
        st = os.stat(path)
        with open(path, "rb") as f:
            data = f.read()
        marked = 0
        for fd in _open_fds():
            try:
                same = os.fstat(fd)
                flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            except OSError:
                continue  # closed meanwhile, or not ours to look at
            if (same.st_dev, same.st_ino) == (st.st_dev, st.st_ino) and flags & os.O_ACCMODE == os.O_RDONLY:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
                marked += 1
        with self._lock:
            self._held[(st.st_dev, st.st_ino)] = (str(path), data)
        return marked

    def release(self) -> None:
        """No more stale reads: the marks are cleared and every read reaches the file."""
        with self._lock:
            held, self._held = self._held, {}
        for fd in _open_fds():
            try:
                st, flags = os.fstat(fd), fcntl.fcntl(fd, fcntl.F_GETFL)
                if (st.st_dev, st.st_ino) in held and flags & os.O_NONBLOCK:
                    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
            except OSError:
                continue

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        with self._lock:
            held = dict(self._held)
        plan = [self._old(op, held) for op in ops] if held else [None] * len(ops)
        real = iter(self.inner.run([op for op, o in zip(ops, plan) if o is None]))
        return [next(real) if o is None else self._serve(op, *o) for op, o in zip(ops, plan)]

    @staticmethod
    def _old(op: IOOp, held: dict[tuple[int, int], tuple[str, bytes]]) -> tuple[str, bytes] | None:
        if op.kind is not OpKind.READ or not fcntl.fcntl(op.fd, fcntl.F_GETFL) & os.O_NONBLOCK:
            return None
        st = os.fstat(op.fd)
        return held.get((st.st_dev, st.st_ino))

    def _serve(self, op: IOOp, path: str, old: bytes) -> IOResult:
        with self._lock:
            self.served += 1
        length = op_length(op)
        data = old[op.offset:op.offset + length]
        if len(data) < length:  # past the bytes held: the file's own (an append is seen through old descriptors)
            with open(path, "rb") as f:
                f.seek(op.offset + len(data))
                data += f.read(length - len(data))
        done = 0
        for buf in op.buffers:
            n = min(buf.nbytes, len(data) - done)
            if n <= 0:
                break
            buf[:n] = data[done:done + n]
            done += n
        if done < length:
            return IOResult(done, None, short_error(op, done), short=True)
        crc, parts = read_digests(op)
        return IOResult(done, crc, part_digests=parts)

    def close(self) -> None:
        """Close the wrapped engine."""
        self.inner.close()


def _open_fds() -> list[int]:
    """This process's open descriptors now."""
    return [int(name) for name in os.listdir("/proc/self/fd")]
