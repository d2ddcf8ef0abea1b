"""One writer of ``bench_cluster``'s pool, run as a process on a lab host (``python -m
benchmarks.cluster.pool_worker``): one JSON command a line on stdin, one JSON reply a line on stdout.

Commands: ``open`` (a ``SharedPool`` writer of the bench namespace on the pool directory), ``put`` (own pages
by key number, chained batch after batch), ``lookups`` (each: a forced refresh, metered; then
``longest_prefix`` of the chain asked and ``get`` of its pages, every page read checked byte for byte),
``visible`` (how many of some keys the view holds after a forced refresh), ``stats``, ``quit``. A failed
command answers ``{"error": ...}``. Pages are ``page_of(n)``: bytes derived from the key number alone, so
any writer checks any page it reads.

What a refresh costs (``RefreshMeter``): its wall time, the files this thread opened under the pool
directory during it (``os.open`` and ``open``), and the bytes this thread read meanwhile (``rchar`` of
``/proc/thread-self/io``, less what reading that file costs).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.io.buffers import AlignedBuffer
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.sharing.pool import SharedPool

BATCH = 8  # pages per pool call
PROC_IO = "/proc/thread-self/io"


def key_of(n: int) -> PageKey:
    """Page key of key number ``n`` (32 bytes)."""
    return PageKey(n.to_bytes(8, "little") * 4)


def page_of(n: int, page_bytes: int) -> bytes:
    """The bytes of page ``n``: the same on every host."""
    return np.random.default_rng(n).integers(0, 256, page_bytes, dtype=np.uint8).tobytes()


def namespace(page_bytes: int) -> Namespace:
    return Namespace(model="bench-cluster", dtype="bfloat16", layout="page_first", page_tokens=16,
                     page_bytes=page_bytes)


def rchar() -> int:
    """Bytes this thread has read through read-like syscalls so far."""
    with open(PROC_IO, "rb") as f:
        for line in f.read().splitlines():
            if line.startswith(b"rchar:"):
                return int(line.split()[1])
    return 0


class RefreshMeter:
    """Meters one call at a time on the calling thread: seconds, files opened under ``root``, bytes read.
    ``os.open`` and ``open`` count only during ``measure`` and only on its thread (other threads, the lease's,
    pass through uncounted); the originals are back when it returns."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = os.path.realpath(root) + os.sep
        self._thread: int | None = None
        self.opened = 0
        first = rchar()
        self._own_read = rchar() - first  # what one look at PROC_IO reads

    def _counting(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if self._thread == threading.get_ident() and isinstance(path, str | os.PathLike) \
                    and os.path.abspath(os.fspath(path)).startswith(self.root):
                self.opened += 1
            return real(path, *args, **kwargs)
        return call

    def measure(self, call: Callable[[], Any]) -> dict[str, float]:
        """Run ``call`` metered: ``s`` (wall seconds), ``files`` (opened under the root), ``bytes`` (read)."""
        real_os_open, real_open = os.open, builtins.open
        self.opened = 0
        self._thread = threading.get_ident()
        os.open = self._counting(real_os_open)  # type: ignore[assignment]
        builtins.open = io.open = self._counting(real_open)  # type: ignore[assignment]
        try:
            before = rchar()
            t0 = time.perf_counter()
            call()
            seconds = time.perf_counter() - t0
            read = max(0, rchar() - before - self._own_read)
        finally:
            os.open, builtins.open, io.open = real_os_open, real_open, real_open  # type: ignore[assignment]
            self._thread = None
        return {"s": seconds, "files": self.opened, "bytes": read}


class Worker:
    def __init__(self) -> None:
        self.pool: SharedPool | None = None
        self.page_bytes = 0
        self.buf: AlignedBuffer | None = None
        self.meter: RefreshMeter | None = None

    def runs(self, j: int) -> list[tuple[int, int]]:
        assert self.buf is not None
        return [(self.buf.address + j * self.page_bytes, self.page_bytes)]

    def page(self, j: int) -> memoryview:
        assert self.buf is not None
        return self.buf.view[j * self.page_bytes:(j + 1) * self.page_bytes]

    def open(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.page_bytes = int(cmd["page_bytes"])
        config = StoreConfig.from_mapping({"devices": [cmd["path"]], **cmd["config"]})
        self.pool = SharedPool.open_writer(config, namespace(self.page_bytes))
        self.buf = AlignedBuffer(BATCH * self.page_bytes)
        self.meter = RefreshMeter(cmd["path"])
        return {"wid": self.pool.wid, "pid": os.getpid()}

    def put(self, numbers: list[int]) -> dict[str, Any]:
        assert self.pool is not None
        ok: list[bool] = []
        t0 = time.perf_counter()
        for start in range(0, len(numbers), BATCH):
            chunk = numbers[start:start + BATCH]
            for j, n in enumerate(chunk):
                self.page(j)[:] = page_of(n, self.page_bytes)
            parent = key_of(numbers[start - 1]) if start else None
            ok += self.pool.put([key_of(n) for n in chunk], [self.runs(j) for j in range(len(chunk))], parent)
        return {"stored": sum(ok), "asked": len(numbers), "s": time.perf_counter() - t0}

    def get(self, numbers: list[int]) -> dict[str, int]:
        assert self.pool is not None
        seen = {"hits": 0, "misses": 0, "wrong": 0}
        for start in range(0, len(numbers), BATCH):
            chunk = numbers[start:start + BATCH]
            for j in range(len(chunk)):
                self.page(j)[:] = bytes(self.page_bytes)
            oks = self.pool.get([key_of(n) for n in chunk], [self.runs(j) for j in range(len(chunk))])
            for j, (n, ok) in enumerate(zip(chunk, oks)):
                if not ok:
                    seen["misses"] += 1
                elif bytes(self.page(j)) == page_of(n, self.page_bytes):
                    seen["hits"] += 1
                else:
                    seen["wrong"] += 1
        return seen

    def lookups(self, chains: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each chain: a forced refresh (metered), then ``longest_prefix`` and ``get`` of its keys."""
        pool, meter = self.pool, self.meter
        assert pool is not None and meter is not None
        out = []
        for chain in chains:
            keys = chain["keys"]
            refresh = meter.measure(lambda: pool.refresh(force=True))
            t0 = time.perf_counter()
            prefix = pool.longest_prefix([key_of(n) for n in keys])
            seen = self.get(keys)
            out.append({"kind": chain["kind"], "of": chain["of"], "asked": len(keys), "prefix": prefix,
                        "refresh_s": refresh["s"], "refresh_files": refresh["files"],
                        "refresh_bytes": refresh["bytes"], "lookup_s": time.perf_counter() - t0, **seen})
        return out

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "open":
            return self.open(cmd)
        if op == "quit":
            if self.pool is not None:
                self.pool.close()
            return {}
        assert self.pool is not None, "open first"
        if op == "put":
            return self.put(cmd["keys"])
        if op == "lookups":
            return {"lookups": self.lookups(cmd["chains"])}
        if op == "visible":  # how many of ``keys`` the pool's view holds after a forced refresh
            self.pool.refresh(force=True)
            return {"n": sum(self.pool.contains(key_of(n)) for n in cmd["keys"])}
        if op == "stats":
            return {"pages": len(self.pool), "peers": sorted(self.pool.peers()), "wid": self.pool.wid,
                    "counters": self.pool.counters.snapshot(), "sharing": self.pool.sharing_stats()}
        raise ValueError(f"unknown op {op!r}")


def main() -> None:
    worker = Worker()
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            out = worker.handle(cmd)
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which stops the run
            out = {"error": type(exc).__name__, "message": str(exc)}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
        if cmd["op"] == "quit":
            break


if __name__ == "__main__":
    main()
