"""Helpers for the real-server tests of streamed L3 tails (``test_stream_server``): switch a running server's
injected faults at the right moment, wait for its log lines, and find and damage stored pages on disk.

- ``FaultControl``: the store's ``fault_injection.control_file`` (``sgl_kvtier.io.faulty``). ``set`` replaces
  it atomically (a temporary file renamed over it, its mtime set before the rename and always moved on, so
  the engine never sees a half-written file nor misses a switch made within one clock tick). The engine
  opens the file only when its mtime changed, at the start of its next ``run``: ``watch()`` reports that
  open (inotify ``IN_OPEN``), the moment the first IO batch after a switch drew its faults from the new
  knobs. Ordering rule the tests build on: a batch's faults are drawn when it starts, so a switch made while
  one batch is in flight applies to the batches after it, never to that one.
- ``verdict_of`` / ``in_background``: what the plugin's verdict line said of a request, a request sent from
  a thread (where an answer's cached tokens came from: ``serving.server.cached_tiers``);
- ``ServerLog``: the server's log, read from a mark; ``wait_for`` wakes at each write to the file (inotify
  ``IN_MODIFY``), bounded by a timeout, or stops early when the caller's condition holds.
- ``cpu_route_missing``: why SGLang's CPU route cannot serve a host layout here (its missing kernels);
- ``stored_slots`` / ``written_chain`` / ``flip_last_bytes``: the slots of the store's segment files
  (``ns-*/w-*/seg-*.dat``: slot = page, then its trailer, ``store.format``) with each one's sequence number,
  key and parent (the key it chains on; none for the first page of a batch stored from the root of the
  tree); the chain a prefix stored alone wrote, once it is on disk (scanned again at each write to the
  segment); a bit flip in the last bytes of a page, as a device returning bad bytes would: for MHA
  ``layer_first`` and ``page_first_direct`` pages those are the V range of the last layer, a part of the
  last layer group (``sglang.parts_plan``).

Linux only (inotify through libc), like the store itself.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import select
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_kvtier.serving.hardware import has_cuda_gpu
from sgl_kvtier.store import format as fmt

IN_MODIFY, IN_OPEN = 0x2, 0x20
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)
_libc = ctypes.CDLL(None, use_errno=True)


class Watch:
    """inotify events of one directory, filtered by file name and mask."""

    def __init__(self, directory: Path, name: str, mask: int) -> None:
        self.name, self.mask = name, mask
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if _libc.inotify_add_watch(self.fd, str(directory).encode(), mask) < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"inotify_add_watch {directory}")
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # wake(): a byte, seen by wait
        self._lock, self._closed = threading.Lock(), False

    def wake(self) -> None:
        """End the current or next ``wait`` now (True), from any thread; a no-op once closed (its fds are gone,
        their numbers maybe another file's)."""
        with self._lock:
            if not self._closed:
                os.write(self._wake_w, b"w")

    def wait(self, timeout_s: float) -> bool:
        """True once an event of ``mask`` names the file or ``wake`` was called; False when ``timeout_s`` passed
        first."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.fd, self._wake_r], [], [], left)
            if not ready:
                return False
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
                return True
            buf, pos = os.read(self.fd, 65536), 0
            hit = False
            while pos + _EVENT.size <= len(buf):
                _, mask, _, length = _EVENT.unpack_from(buf, pos)
                name = buf[pos + _EVENT.size:pos + _EVENT.size + length].rstrip(b"\0").decode(errors="replace")
                pos += _EVENT.size + length
                hit = hit or (bool(mask & self.mask) and name == self.name)
            if hit:
                return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fd in (self.fd, self._wake_r, self._wake_w):
                os.close(fd)


class FaultControl:
    """A running server's fault control file (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime = 0
        self.set()

    def set(self, **knobs: Any) -> None:
        """Make ``knobs`` (keys of ``config.FAULT_KNOBS``; none: no faults) the ones in force from the next IO batch."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(knobs))
        self._mtime = max(time.time_ns(), self._mtime + 1_000_000)  # always a new mtime, even within one tick
        os.utime(tmp, ns=(self._mtime, self._mtime))
        os.replace(tmp, self.path)

    @contextmanager
    def watch(self) -> Iterator[Watch]:
        """Reports the engine's next open of the file (``wait``): arm it before the ``set`` it should see."""
        watch = Watch(self.path.parent, self.path.name, IN_OPEN)
        try:
            yield watch
        finally:
            watch.close()


class ServerLog:
    """The server's log file, read from a mark."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def mark(self) -> int:
        return self.path.stat().st_size

    def since(self, mark: int = 0) -> str:
        with self.path.open("rb") as f:
            f.seek(mark)
            return f.read().decode("utf-8", errors="replace")

    def wait_for(self, needle: str, since: int, timeout_s: float = 120.0,
                 stop: Future[Any] | None = None) -> str | None:
        """The log from ``since`` once it holds ``needle``; None if ``stop`` finished first (looked at each write
        to the log and when it finishes: its end wakes the wait, as its last log line may come before it);
        AssertionError after ``timeout_s``."""
        watch = Watch(self.path.parent, self.path.name, IN_MODIFY)  # armed before the first look: no write missed
        if stop is not None:
            stop.add_done_callback(lambda _: watch.wake())  # runs at once if it is done already
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                text = self.since(since)
                if needle in text:
                    return text
                if stop is not None and stop.done():
                    text = self.since(since)
                    return text if needle in text else None
                if not watch.wait(deadline - time.monotonic()) and needle not in self.since(since):
                    raise AssertionError(f"{needle!r} not in the server log within {timeout_s:.0f} s")
        finally:
            watch.close()


# ---------------------------------------------------------------------------------------------- answers
def verdict_of(log: str, rid: str) -> str | None:
    """``landed`` / ``retracted`` as the plugin's verdict line named ``rid``, or None (never loaded streamed)."""
    match = re.search(rf"[( ]{re.escape(rid)}=(landed|retracted)\b", log)
    return None if match is None else match.group(1)


def in_background(fn: Callable[[], dict[str, Any]]) -> Future[dict[str, Any]]:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


# ---------------------------------------------------------------------------------------------- the CPU route
def cpu_route_missing(layout: str) -> str | None:
    """Why SGLang's CPU route cannot serve ``layout`` here (None: it can). ``page_first_direct`` moves KV with
    two sgl_kernel ops that SGLang imports only on CUDA/ROCm/XPU (``pool_host/mha.py:60-88``); on CPU the
    names are missing (NameError in the first backup) unless our CPU shims provide them."""
    if layout != "page_first_direct" or has_cuda_gpu():
        return None
    from sgl_kvtier.sglang.plugins import cpu_shims

    ops = ("transfer_kv_all_layer_direct_lf_pf", "transfer_kv_per_layer_direct_pf_lf")
    absent = [op for op in ops if not hasattr(cpu_shims, op)]
    return f"page_first_direct on CPU needs torch stand-ins for {', '.join(absent)}" if absent else None


# ---------------------------------------------------------------------------------------------- stored pages
GEOMETRY = re.compile(r"kvtier: pool kv -> ns-\w+ .* page=\d+t/(\d+)B .* parts=(\d+)")


def page_geometry(log: str) -> tuple[int, int]:
    """(page bytes, parts per page) of the KV pool, from the backend's line at start-up."""
    match = GEOMETRY.search(log)
    assert match, "the backend's pool line (kvtier: pool kv -> ...) is not in the log"
    return int(match.group(1)), int(match.group(2))


def segments(store: Path) -> list[Path]:
    return sorted(store.glob("ns-*/w-*/seg-*.dat"))


@dataclass(frozen=True)
class Slot:
    """One written slot of a segment file, as its trailer describes it."""

    segment: Path
    offset: int  # of the slot in the segment file
    seq: int  # the writer's sequence number: later writes have higher ones
    key: bytes
    parent: bytes | None  # the key this page chains on (None: the first page of a root chain)


def stored_slots(store: Path, page_bytes: int, parts: int) -> list[Slot]:
    """Every slot of the store's segment files holding a valid trailer."""
    slot = fmt.slot_bytes_for(page_bytes, parts)
    size = fmt.trailer_bytes(parts)
    out: list[Slot] = []
    for seg in segments(store):
        fd = os.open(seg, os.O_RDONLY)
        try:
            for offset in range(0, os.fstat(fd).st_size - slot + 1, slot):
                trailer = fmt.unpack_trailer(os.pread(fd, size, offset + page_bytes))
                if trailer is not None:
                    out.append(Slot(seg, offset, trailer.seq, trailer.key, trailer.parent))
        finally:
            os.close(fd)
    return out


def root_chains(slots: list[Slot]) -> list[list[Slot]]:
    """The chains of ``slots`` that start at a root page (no parent), each followed child by child."""
    by_parent = {s.parent: s for s in slots if s.parent is not None}
    chains = []
    for root in (s for s in slots if s.parent is None):
        chain = [root]
        while chain[-1].key in by_parent and len(chain) <= len(slots):
            chain.append(by_parent[chain[-1].key])
        chains.append(chain)
    return chains


def written_chain(store: Path, page_bytes: int, parts: int, after_seq: int, pages: int,
                  timeout_s: float = 60.0) -> list[Slot]:
    """The one root chain of exactly ``pages`` pages written after ``after_seq`` (a prefix stored alone), once it
    is on disk: the segment files are scanned again at each write to them (inotify), up to ``timeout_s``."""
    (seg,) = segments(store)  # one writer, one segment (capacity below segment_bytes)
    watch = Watch(seg.parent, seg.name, IN_MODIFY)  # armed before the first scan: no write missed
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            fresh = [s for s in stored_slots(store, page_bytes, parts) if s.seq > after_seq]
            found = [c for c in root_chains(fresh) if len(c) == pages]
            if len(found) == 1:
                return found[0]
            if not watch.wait(deadline - time.monotonic()):
                raise AssertionError(f"no single new root chain of {pages} pages on disk within {timeout_s:.0f} s: "
                                     f"{sorted(len(c) for c in root_chains(fresh))}")
    finally:
        watch.close()


def flip_last_bytes(slots: list[Slot], page_bytes: int, back: int = 64) -> None:
    """Invert one byte ``back`` bytes before the end of each slot's page (its trailer stays valid)."""
    for slot in slots:
        fd = os.open(slot.segment, os.O_RDWR)
        try:
            at = slot.offset + page_bytes - back
            byte = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), at)
            os.fsync(fd)
        finally:
            os.close(fd)
