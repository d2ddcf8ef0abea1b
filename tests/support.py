"""Shared test helpers: host memory shaped like SGLang's host pool, and store factories."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.io.buffers import AlignedBuffer
from sgl_kvtier.keys import Namespace
from sgl_kvtier.store import PageStore

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


def key(n: int) -> bytes:
    return n.to_bytes(4, "little") * 8


def store_config(path: Path | str, capacity_pages: int = 64, page_bytes: int = PAGE_BYTES, **config) -> StoreConfig:
    config.setdefault("devices", (str(path),))
    config.setdefault("capacity_bytes", capacity_pages * page_bytes)
    config.setdefault("segment_bytes", 1 << 20)
    config["devices"] = [str(d) for d in config["devices"]]
    return StoreConfig.from_mapping(config)


def open_store(path: Path | str, capacity_pages: int = 64, page_bytes: int = PAGE_BYTES, ns: Namespace | None = None,
               **config) -> PageStore:
    return PageStore.open(store_config(path, capacity_pages, page_bytes, **config), ns or namespace(page_bytes))


def random_key() -> bytes:
    return os.urandom(32)


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


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module; ``benchmarks/`` goes on ``sys.path`` first, as the scripts'
    own imports (``serving``, ``bench_serving``) need when they run as scripts."""
    import importlib.util
    import sys

    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
