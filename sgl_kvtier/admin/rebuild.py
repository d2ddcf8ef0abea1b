"""Rebuild one writer's index from its pages alone (``sgl-kvtier fsck --rebuild``), when its journal and
checkpoint are gone or damaged.

Every slot on disk of the writer's ``Layout`` is read sequentially and its trailer (``store.format``) decoded;
a slot is skipped as ``empty`` (no trailer magic), ``bad_trailer``, ``foreign`` (another namespace) or
``torn`` (bytes failing the trailer's checksums). Of several good copies of a key the highest seq wins
(equal: lowest slot; the others ``superseded``); any good copy is right, since a key names fixed bytes. The
output is a fresh ``checkpoint.bin`` (replaced atomically) of the kept pages coldest first, at the highest
seq seen and a generation above every journal present (which it deletes), so the next open serves every kept
page. Deleted or unacknowledged pages may come back (their bytes are still right).

Invariants: ``rebuild`` holds the writer's ``LOCK`` (``flock``, as a writer does) from its first read until the
checkpoint is durable, so it never races a live writer (``StoreLockedError``); it writes only the writer's
meta files (``checkpoint.bin``, ``CONFIG`` when absent, ``LOCK``), never the devices; a crash mid-rebuild
leaves the old meta as it was.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import xxhash

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import DeviceError, StoreLockedError
from sgl_kvtier.io.buffers import AlignedBuffer
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.sharing.writers import try_lock
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store import journal_write as jw
from sgl_kvtier.store.devices import Arena, DirectoryArena, fsync_dir
from sgl_kvtier.store.layout import Layout
from sgl_kvtier.store.lifecycle import release_all
from sgl_kvtier.store.meta import save_config

log = logging.getLogger(__name__)
READ_BYTES = 8 << 20  # bytes per sequential read
LOG_EVERY_S = 10.0  # a progress log line at most this often (without a progress callback too)


@dataclass
class RebuildReport:
    """What a rebuild of one writer found and kept (slot counts by fate)."""

    meta: str
    slots_scanned: int = 0
    pages: int = 0  # kept: in the new checkpoint
    parents: int = 0  # kept pages whose chain parent was kept too
    empty: int = 0  # no trailer magic
    bad_trailer: int = 0  # a trailer failing its checksum (or of another format / parts count)
    foreign: int = 0  # a trailer of another namespace
    torn: int = 0  # page bytes failing the trailer's checksums
    superseded: int = 0  # a good copy of a key also kept elsewhere with a higher seq
    unreadable: int = 0  # slots a read error or a short (truncated) segment left unread
    seq: int = 0  # the highest seq seen: the new checkpoint's, so later writes sort above every page


@dataclass
class _Kept:
    seq: int
    slot: int
    checksums: tuple[int, ...]
    parent: bytes | None


def lock_writer(meta: Path) -> int:
    """Take writer ``meta``'s ``LOCK`` as a writer does (the directory is made if missing); the descriptor.

    Raises StoreLockedError (a live writer holds it) or DeviceError (not writable)."""
    try:
        made = [p for p in (meta, *meta.parents) if not p.exists()]
        meta.mkdir(mode=0o700, parents=True, exist_ok=True)
        for parent in reversed([p.parent for p in made]):
            fsync_dir(parent)  # crash rule: a directory made here survives a power cut (its parent synced)
        fd = os.open(meta / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise DeviceError(f"{meta}: not writable ({exc.strerror})") from None
    holder = try_lock(fd, meta)
    if holder is not None:
        raise StoreLockedError(f"{meta}: open for writing by pid {holder}; stop that writer to rebuild it")
    return fd


def unlock_writer(fd: int) -> None:
    """Give ``lock_writer``'s lock up and close it (both attempted)."""
    release_all([("unlock", partial(fcntl.flock, fd, fcntl.LOCK_UN)), ("close", partial(os.close, fd))])


def extents(arena: Arena) -> list[tuple[int, int]]:
    """``(first local slot, count)`` of the arena's slots that exist on disk: the segment files present on
    a directory device (a truncated one reads short), the whole region of a raw one."""
    if isinstance(arena, DirectoryArena):
        per, found = arena.slots_per_segment, []
        for path in sorted(arena.dir.glob("seg-*.dat")):
            try:
                seg, size = int(path.stem.split("-")[1]), path.stat().st_size
            except (ValueError, IndexError, FileNotFoundError):
                continue
            if size:  # a partial last slot is read (short: ``unreadable``)
                found.append((seg * per, min(per, -(-size // arena.slot_bytes))))
        return found
    return [(0, arena.capacity_slots)]


def slots_to_scan(layout: Layout) -> int:
    """How many slots ``rebuild`` reads (for a progress bar's total)."""
    return sum(n for a in layout.arenas for _, n in extents(a))


def rebuild(config: StoreConfig, namespace: Namespace, layout: Layout, *,
            progress: Callable[[int], object] | None = None, parts: Sequence[int] | None = None) -> RebuildReport:
    """Rebuild the index of the writer whose open layout is ``layout`` (see the module docstring).
    ``progress`` is called with the number of slots read after each read; ``parts``: the byte length of
    each checksummed part of a page (the namespace header's; default: the namespace's, ``part_sizes``).

    Raises StoreLockedError (a live writer holds its lock), DeviceError (slots without room for a
    trailer: not format 2), OSError (writing the meta), ValueError (``parts`` not adding up to a page)."""
    part_sizes = list(parts or namespace.part_sizes())
    if sum(part_sizes) != namespace.page_bytes:
        raise ValueError(f"parts {part_sizes} do not add up to the page's {namespace.page_bytes} bytes")
    if layout.slot_bytes < namespace.page_bytes + fmt.trailer_bytes(len(part_sizes)):
        raise DeviceError(f"{layout.meta}: slots of {layout.slot_bytes} bytes hold no trailer after "
                          f"{namespace.page_bytes}-byte pages: nothing to rebuild from")
    fd = lock_writer(layout.meta)
    try:
        report = RebuildReport(str(layout.meta))
        kept = _scan(layout, namespace.digest(), namespace.page_bytes, part_sizes, report, progress)
        _write_index(layout.meta, kept, report)
        if not (layout.meta / "CONFIG").exists():
            save_config(layout.meta, config)  # so offline tools and the next writer see the same devices
    finally:
        unlock_writer(fd)
    log.info("%s: rebuilt %d pages from %d slots (%d torn, %d foreign, %d bad trailers, %d unreadable)",
             layout.meta, report.pages, report.slots_scanned, report.torn, report.foreign, report.bad_trailer,
             report.unreadable)
    return report


def _scan(layout: Layout, ns_digest: bytes, page_bytes: int, parts: list[int], report: RebuildReport,
          progress: Callable[[int], object] | None) -> dict[bytes, _Kept]:
    slot_bytes, ndev = layout.slot_bytes, len(layout.arenas)
    per_read = max(1, READ_BYTES // slot_bytes)
    buf = AlignedBuffer(per_read * slot_bytes)
    kept: dict[bytes, _Kept] = {}
    last_log = time.monotonic()
    try:
        for index, arena in enumerate(layout.arenas):
            for first, count in extents(arena):
                fd, base = arena.locate(first)  # an existing segment: nothing is created
                for done in range(0, count, per_read):
                    n = min(per_read, count - done)
                    got = _read(fd, buf.view[:n * slot_bytes], base + done * slot_bytes, slot_bytes)
                    for k in range(n):
                        local = first + done + k
                        if got[k]:
                            _check_slot(buf.view[k * slot_bytes:(k + 1) * slot_bytes], local * ndev + index,
                                        ns_digest, page_bytes, parts, report, kept)
                        else:
                            report.unreadable += 1
                    report.slots_scanned += n
                    if progress is not None:
                        progress(n)
                    if time.monotonic() - last_log > LOG_EVERY_S:
                        last_log = time.monotonic()
                        log.info("%s: rebuild read %d slots, %d pages so far", layout.meta, report.slots_scanned,
                                 len(kept))
    finally:
        buf.close()
    return kept


def _read(fd: int, dst: memoryview, offset: int, slot_bytes: int) -> list[bool]:
    """Read ``dst`` (whole slots) from ``offset``; per slot, whether all its bytes came. A failed read is
    retried slot by slot, so one bad sector costs one slot, not the whole read."""
    nslots = dst.nbytes // slot_bytes
    try:
        done = _read_fully(fd, dst, offset)
        return [(k + 1) * slot_bytes <= done for k in range(nslots)]
    except OSError as exc:
        if nslots == 1:
            log.warning("read of %d bytes at offset %d failed: %s", dst.nbytes, offset, exc)
            return [False]
    return [_read(fd, dst[k * slot_bytes:(k + 1) * slot_bytes], offset + k * slot_bytes, slot_bytes)[0]
            for k in range(nslots)]


def _read_fully(fd: int, dst: memoryview, offset: int) -> int:
    """Bytes read into ``dst`` from ``offset`` until it is full or the file ends."""
    total = 0
    while total < dst.nbytes:
        n = os.preadv(fd, [dst[total:]], offset + total)
        if n <= 0:
            break
        total += n
    return total


def _check_slot(data: memoryview, slot: int, ns_digest: bytes, page_bytes: int, parts: list[int],
                report: RebuildReport, kept: dict[bytes, _Kept]) -> None:
    """Decide one slot's fate (see the module docstring) and keep its page when it is the newest good one."""
    tail = data[page_bytes:page_bytes + fmt.trailer_bytes(len(parts))]
    if tail[:len(fmt.TRAILER_MAGIC)] != fmt.TRAILER_MAGIC:
        report.empty += 1
        return
    trailer = fmt.unpack_trailer(bytes(tail))
    if trailer is None or len(trailer.checksums) != len(parts):
        report.bad_trailer += 1
        return
    if trailer.ns_digest != ns_digest:
        report.foreign += 1
        return
    report.seq = max(report.seq, trailer.seq)  # torn pages too: later writes must sort above every trailer
    at = 0
    for size, want in zip(parts, trailer.checksums):
        if xxhash.xxh3_64_intdigest(data[at:at + size]) != want:
            report.torn += 1
            return
        at += size
    old = kept.get(trailer.key)
    if old is not None:
        report.superseded += 1
        if (old.seq, -old.slot) >= (trailer.seq, -slot):
            return
    kept[trailer.key] = _Kept(trailer.seq, slot, trailer.checksums, trailer.parent)


def _write_index(meta: Path, kept: dict[bytes, _Kept], report: RebuildReport) -> None:
    """The kept pages as ``meta``'s checkpoint, coldest (lowest seq) first, above every journal present."""
    order = sorted(kept.items(), key=lambda kv: (kv[1].seq, kv[1].slot))
    position = {key: i for i, (key, _) in enumerate(order)}
    keys = [PageKey(key) for key, _ in order]
    slots = np.array([k.slot for _, k in order], dtype=np.int64)
    checksums = np.array([c for _, k in order for c in k.checksums], dtype=np.uint64)
    parents = np.array([position.get(k.parent, -1) if k.parent is not None and k.parent != key else -1
                        for key, k in order], dtype=np.int64)
    report.pages, report.parents = len(keys), int((parents >= 0).sum())
    generation = max(jr.journal_generations(meta), default=0) + 1
    jw.write_checkpoint(meta, keys, slots, checksums, parents, report.seq, generation)
