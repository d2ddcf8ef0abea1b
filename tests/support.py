"""Shared test helpers: host memory shaped like SGLang's host pool, and store factories."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.io.buffers import AlignedBuffer
from sgl_kvtier.io.engine import IOOp, IOResult, ThreadPoolEngine
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.store.format import slot_bytes_for
from sgl_kvtier.store.page_store import PageStore

PAGE_BYTES = 16 * 1024


def namespace(page_bytes: int = PAGE_BYTES, **overrides) -> Namespace:
    fields = dict(model="test-model", dtype="bfloat16", layout="page_first", page_tokens=16, page_bytes=page_bytes)
    fields.update(overrides)
    return Namespace(**fields)


class HostMemory:
    """``pages`` page slots of aligned memory; page i is two runs (K half, V half) like page_first."""

    def __init__(self, pages: int, page_bytes: int = PAGE_BYTES, runs_per_page: int = 2, offset: int = 0):
        self.page_bytes = page_bytes
        self.runs_per_page = runs_per_page
        self.offset = offset  # a non-zero offset makes runs unaligned (forces the bounce path)
        self.buffer = AlignedBuffer(pages * page_bytes + offset)
        self.array = np.frombuffer(self.buffer.view, dtype=np.uint8)[offset:offset + pages * page_bytes]

    def runs(self, page: int) -> list[tuple[int, int]]:
        base = self.buffer.address + self.offset + page * self.page_bytes
        step = self.page_bytes // self.runs_per_page
        return [(base + r * step, step) for r in range(self.runs_per_page)]

    def page(self, page: int) -> np.ndarray:
        return self.array[page * self.page_bytes:(page + 1) * self.page_bytes]

    def fill(self, page: int, seed: int) -> bytes:
        data = np.random.default_rng(seed).integers(0, 256, self.page_bytes, dtype=np.uint8)
        self.page(page)[:] = data
        return data.tobytes()

    def clear(self) -> None:
        self.array[:] = 0


class EngineWrapper:
    """An IO engine that passes every batch to a real thread-pool engine; a test's subclass overrides
    ``run`` to bend what the device does or reports, without sleeping."""

    name = "wrapped"

    def __init__(self, depth: int = 4):
        self.inner = ThreadPoolEngine(depth)

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        return self.inner.run(ops)

    def close(self) -> None:
        self.inner.close()


def key(n: int) -> PageKey:
    return PageKey(n.to_bytes(4, "little") * 8)


def store_config(path: Path | str, capacity_pages: int = 64, page_bytes: int = PAGE_BYTES, **config) -> StoreConfig:
    config.setdefault("devices", (str(path),))
    config.setdefault("capacity_bytes", capacity_pages * slot_bytes_for(page_bytes))  # a slot: page + trailer
    config.setdefault("segment_bytes", 1 << 20)
    config["devices"] = [str(d) for d in config["devices"]]
    return StoreConfig.from_mapping(config)


def open_store(path: Path | str, capacity_pages: int = 64, page_bytes: int = PAGE_BYTES, ns: Namespace | None = None,
               **config) -> PageStore:
    return open_writer(store_config(path, capacity_pages, page_bytes, **config), ns or namespace(page_bytes))


def slot_file(store: PageStore, k: PageKey) -> tuple[Path, int]:
    """The segment file holding page ``k``'s slot, and the slot's byte offset in it."""
    slot = store.slot_of(k)
    assert slot is not None
    arena = store.layout.arenas[slot % len(store.layout.arenas)]
    seg, index = divmod(slot // len(store.layout.arenas), arena.slots_per_segment)
    return arena.dir / f"seg-{seg:05d}.dat", index * store.slot_bytes


def flip(store: PageStore, k: PageKey, at: int) -> None:
    """Flip one byte at offset ``at`` of page ``k``'s slot, in its segment file."""
    path, base = slot_file(store, k)
    with open(path, "r+b") as f:
        f.seek(base + at)
        byte = f.read(1)[0]
        f.seek(base + at)
        f.write(bytes([byte ^ 0x5A]))


def random_key() -> PageKey:
    return PageKey(os.urandom(32))


def run_concurrently(*targets) -> None:
    """Start ``targets`` on their own threads at the same moment; re-raise the first exception any raised."""
    import threading

    barrier, failures = threading.Barrier(len(targets)), []

    def wrap(fn):
        def body():
            barrier.wait()
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread below
                failures.append(exc)
        return body

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


# ---------------------------------------------------------------------- lifecycle checks (open / close)
def open_fds_under(root: Path | str) -> dict[int, str]:
    """This process's open descriptors on paths under ``root``, ``{fd: path}`` (``/proc/self/fd`` links
    resolved; a file deleted meanwhile still shows, as ``'<path> (deleted)'``)."""
    prefix = os.path.realpath(root) + os.sep
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed between the listing and the look (the listing's own descriptor)
            continue
        if target.startswith(prefix):
            found[int(name)] = target
    return found


def kvtier_threads() -> set:
    """The live threads whose names start with ``kvtier-`` (IO engine and read-ahead pools)."""
    import threading

    return {t for t in threading.enumerate() if t.name.startswith("kvtier-")}


_TAKE_LOCK = """
import fcntl, os, sys
os.makedirs(sys.argv[1], mode=0o700, exist_ok=True)
fd = os.open(os.path.join(sys.argv[1], "LOCK"), os.O_RDWR | os.O_CREAT, 0o600)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(3)
fcntl.flock(fd, fcntl.LOCK_UN)
"""


def lock_free_elsewhere(meta: Path) -> bool:
    """Whether another process can take the writer lock of the writer directory ``meta`` now (the
    ``flock`` that ``sharing.writers.claim_writer`` takes, given back at once)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", _TAKE_LOCK, str(meta)], capture_output=True, text=True,
                          timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode in (0, 3), done.stderr
    return done.returncode == 0


class OSFaults:
    """A stand-in for the ``os`` module as one store module sees it, failing some calls the way a sick or
    full device does: ``monkeypatch.setattr(module, "os", OSFaults(errno.EIO, {"fsync"}, "journal-"))``.

    Each call named in ``calls`` (``open``, ``write``, ``fsync``, ``close``) raises ``OSError(error)`` when
    its path (for a descriptor: what ``/proc/self/fd`` names) contains ``path``; everything else goes to
    ``os``. A failing ``close`` closes the descriptor first, as Linux does when close(2) reports an error.
    ``failed`` lists the paths of the calls it failed, in order.
    """

    def __init__(self, error: int, calls: set[str], path: str):
        self.error, self.calls, self.path = error, set(calls), path
        self.failed: list[str] = []

    def __getattr__(self, name: str):
        return getattr(os, name)

    def _fail(self, call: str, path: str) -> None:
        if call in self.calls and self.path in path:
            self.failed.append(path)
            raise OSError(self.error, os.strerror(self.error), path)

    @staticmethod
    def _path_of(fd: int) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        self._fail("open", os.fspath(path))
        return os.open(path, flags, mode, dir_fd=dir_fd)

    def write(self, fd: int, data) -> int:
        self._fail("write", self._path_of(fd))
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        self._fail("fsync", self._path_of(fd))
        os.fsync(fd)

    def close(self, fd: int) -> None:
        path = self._path_of(fd)
        os.close(fd)
        self._fail("close", path)
