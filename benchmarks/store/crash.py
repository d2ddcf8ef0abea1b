"""The crash harness of ``reliability crash``: a writer process (``benchmarks.store.crash_writer``) puts seeded
pages and reports every acknowledged batch; the parent SIGKILLs it at a chosen point and checks the reopened
store. Page n's bytes are a pure function of n, so any page served can be verified."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import REPO
from benchmarks.store.hostpool import HostPool
from benchmarks.store.stores import SMALL_SEGMENT, open_store
from sgl_kvtier.store.page_store import PageStore

PAGE = 8192
CAPACITY = 96  # pages: small, so eviction runs


def key(n: int) -> bytes:
    """Page n's 32-byte key (n, little-endian, repeated)."""
    return n.to_bytes(4, "little") * 8


def page_bytes_for(n: int, page_bytes: int = PAGE) -> bytes:
    return np.random.default_rng(n).integers(0, 256, page_bytes, dtype=np.uint8).tobytes()


def open_small(path: Path | str, capacity_pages: int = CAPACITY, **keys) -> PageStore:
    """A small store of ``PAGE``-byte pages (1 MiB segments) in ``path``."""
    return open_store(Path(path), PAGE, capacity_pages * PAGE, page_tokens=16, segment_bytes=SMALL_SEGMENT, **keys)


def run_and_kill(path: Path, seed: int, durability: str, kill_after_acks: int) -> tuple[set[int], set[int]]:
    """Start a writer, SIGKILL it after ``kill_after_acks`` acks; (acknowledged and not deleted, deleted)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.store.crash_writer", str(path), str(seed), durability],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    acked, deleted, acks = set(), set(), 0

    def take(line: str) -> None:
        parts = line.split()
        if parts and parts[0] == "ack":
            first, count, oks = int(parts[1]), int(parts[2]), parts[3]
            acked.update(first + j for j in range(count) if oks[j] == "1")
        elif parts and parts[0] == "del":
            deleted.add(int(parts[1]))

    assert proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("crash writer did not start")
        for line in proc.stdout:
            take(line)
            acks += line.startswith("ack")
            if acks >= kill_after_acks:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        for line in proc.stdout:  # what it printed before the kill landed
            take(line)
        proc.wait()
    return acked - deleted, deleted


def check_store(path: Path, must_have: list[int]) -> tuple[int, int, int]:
    """Reopen and read every page: (pages checked, wrong bytes served, acknowledged pages lost)."""
    mem = HostPool(PAGE, 1)
    checked = wrong = 0
    with open_small(path, eviction="lru") as store:
        for k in store.keys():
            if store.get([k], [mem.runs(0)]) == [True]:
                checked += 1
                wrong += mem.read(0) != page_bytes_for(int.from_bytes(k[:4], "little"))
        lost = sum(not store.contains(key(n)) for n in must_have)
    return checked, wrong, lost
