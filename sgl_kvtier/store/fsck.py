"""Offline inspection and verification of stores, for ``sgl-kvtier inspect`` and ``sgl-kvtier fsck``.

``find_shards(path)`` finds the namespace shards reachable from a path: a directory device (or meta dir)
holds ``ns-*/HEADER``; a raw block device's region table names each shard's meta directory.

``fsck`` reads every indexed page and checks it against its recorded checksum, and reports journal or
checkpoint damage found by recovery. With ``repair`` it opens the shard as the writer: recovery already
folds the readable journal into a fresh checkpoint and discards torn tails, and every page that fails
verification is dropped (journaled as deleted). Without ``repair`` nothing on disk changes.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sgl_kvtier.io.buffers import AlignedBuffer
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.devices import is_block_like
from sgl_kvtier.store.layout import load_config
from sgl_kvtier.store.page_store import PageStore
from sgl_kvtier.store.reader import PageReader

VERIFY_BATCH = 32


@dataclass
class Shard:
    """A namespace shard found on disk: its meta directory, namespace and meta header."""

    meta: Path
    namespace: Namespace
    header: dict[str, Any]


@dataclass
class FsckReport:
    """What ``fsck`` found in one shard (and whether it repaired it)."""

    namespace: str
    meta: str
    pages_checked: int = 0
    bad_pages: list[str] = field(default_factory=list)  # hex keys
    problems: list[str] = field(default_factory=list)  # journal / checkpoint damage
    repaired: bool = False

    @property
    def clean(self) -> bool:
        """No bad page and no journal or checkpoint damage."""
        return not self.bad_pages and not self.problems


def find_shards(path: str) -> list[Shard]:
    """The namespace shards reachable from ``path`` (see the module docstring); [] for none."""
    p = Path(path)
    metas: list[Path] = []
    if p.is_dir():
        metas = sorted(d for d in ([p] if (p / "HEADER").exists() else p.glob("ns-*")) if (d / "HEADER").exists())
    elif p.exists() and is_block_like(path):
        with open(path, "rb") as f:
            head = f.read(fmt.BLOCK_HEADER_BYTES)
        if head.startswith(fmt.REGION_MAGIC):
            table = fmt.unpack_header(fmt.REGION_MAGIC, head, f"{path} region table")
            metas = [Path(r["header"]["meta_dir"]) / ("ns-" + r["ns"].hex()) for r in table["regions"]]
    shards = []
    for meta in metas:
        header = fmt.unpack_header(fmt.HEADER_MAGIC, (meta / "HEADER").read_bytes(), str(meta / "HEADER"))
        shards.append(Shard(meta, Namespace.from_mapping(header["namespace"]), header))
    return shards


def open_shard(shard: Shard) -> PageReader:
    """A read-only view of ``shard``, with the config its writer recorded (changes nothing on disk)."""
    return PageReader.open(load_config(shard.meta), shard.namespace)


def open_writer(shard: Shard) -> PageStore:
    """``shard``'s writer (takes its lock; recovery folds the journal into a new checkpoint)."""
    return PageStore.open(load_config(shard.meta), shard.namespace)


def fsck(shard: Shard, repair: bool = False, progress: Callable[[int], object] | None = None) -> FsckReport:
    """Verify every page and the journal of ``shard``; with ``repair``, drop what is bad (as its writer).
    ``progress`` is called with the number of pages checked after each batch."""
    report = FsckReport(shard.namespace.describe(), str(shard.meta))
    # ``with``: an error of the body is the one raised; a failing close rides along as its note.
    with open_shard(shard) as store:
        report.problems = list(store.recovery.problems)
        keys = store.keys()
        scratch = AlignedBuffer(VERIFY_BATCH * store.slot_bytes)
        try:
            for start in range(0, len(keys), VERIFY_BATCH):
                chunk = keys[start:start + VERIFY_BATCH]
                runs = [[(scratch.address + i * store.slot_bytes, store.page_bytes)] for i in range(len(chunk))]
                for k, ok in zip(chunk, store.get(chunk, runs)):
                    if not ok:
                        report.bad_pages.append(k.hex())
                report.pages_checked += len(chunk)
                if progress is not None:
                    progress(len(chunk))
        finally:
            scratch.close()
    if repair and not report.clean:
        with open_writer(shard) as writer:  # recovery folds the journal and drops torn tails
            writer.delete([PageKey(bytes.fromhex(k)) for k in report.bad_pages])
        report.repaired = True
    return report


def shard_summary(shard: Shard) -> dict[str, Any]:
    """What ``sgl-kvtier inspect`` shows of ``shard`` (JSON-ready), read without changing anything."""
    with open_shard(shard) as store:
        stats = store.stats()
        return {
            "namespace": shard.namespace.describe(), "meta": str(shard.meta), "pages": stats.pages,
            "bytes_used": stats.bytes_used, "capacity_bytes": _configured_capacity(shard, stats.capacity_bytes),
            "devices": stats.devices, "format_version": shard.header.get("format_version"),
            "direct_io": stats.direct_io, "problems": list(store.recovery.problems),
            "locked_by_writer": _writer_pid(shard.meta),
        }


def _configured_capacity(shard: Shard, fallback: int) -> int:
    cfg = load_config(shard.meta)
    return cfg.capacity_bytes if cfg.capacity_bytes is not None else fallback


def _writer_pid(meta: Path) -> int | None:
    try:
        fd = os.open(meta / "LOCK", os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)
