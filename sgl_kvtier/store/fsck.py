"""Offline inspection and verification of stores, for ``sgl-kvtier inspect`` and ``sgl-kvtier fsck``.

``find_shards(path)`` finds the namespace shards reachable from a path: a directory device (or meta dir)
holds ``ns-*/HEADER``; a raw block device's region table names each shard's meta directory.

``fsck`` reads every indexed page and checks it against its recorded checksum, and reports journal or
checkpoint damage found by recovery. With ``repair`` it opens the shard as the writer: recovery already
folds the readable journal into a fresh checkpoint and discards torn tails, and every page that fails
verification is dropped (journaled as deleted). Without ``repair`` nothing on disk changes.

``rebuild_shard`` (``fsck --rebuild``) rebuilds the index of each writer of a shard from its pages alone
(``store.rebuild``): the writers are those with a directory in the namespace's meta directory, a
``ns-<digest>/w-<wid>/`` of segments on a directory device, or a region on a raw device. Each is rebuilt
under its own ``LOCK``; one held by a live writer is reported and left alone. The config is the one a
writer recorded (``CONFIG``), else the namespace header's devices with the segment size read off the
segment files.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import KVTierError
from sgl_kvtier.io.buffers import AlignedBuffer
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.devices import is_block_like
from sgl_kvtier.store.layout import load_config, open_layout
from sgl_kvtier.store.page_store import PageStore
from sgl_kvtier.store.reader import PageReader
from sgl_kvtier.store.rebuild import RebuildReport, rebuild, slots_to_scan
from sgl_kvtier.store.writers import WRITER_PREFIX, writer_dirname, writer_dirs

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
            metas = list(dict.fromkeys(Path(r["header"]["meta_dir"]) / ("ns-" + r["ns"].hex())
                                       for r in table["regions"]))  # one per namespace, not per writer
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
    """The pid of a live writer of the namespace in ``meta`` (the first found holding its ``LOCK``)."""
    for _, path in writer_dirs(meta):
        pid = _lock_holder(path)
        if pid is not None:
            return pid
    return None


def _lock_holder(meta: Path) -> int | None:
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


# ------------------------------------------------------------------------------------------- rebuild
ProgressStart = Callable[[str, int], Callable[[int], object]]  # (label, slots to read) -> per-read callback


@dataclass
class WriterRebuild:
    """The outcome of rebuilding one writer of a shard: its report, or why it was not rebuilt."""

    namespace: str
    wid: str
    report: RebuildReport | None = None
    error: str | None = None


def writer_ids(shard: Shard, config: StoreConfig) -> list[str]:
    """Every writer of ``shard`` with meta or pages anywhere (see the module docstring), sorted."""
    wids = {wid for wid, _ in writer_dirs(shard.meta)}
    digest = shard.namespace.digest()
    for dev in config.devices:
        if Path(dev).is_dir():
            wids.update(wid for wid, _ in writer_dirs(Path(dev) / shard.namespace.dirname()))
        elif Path(dev).exists():
            with open(dev, "rb") as f:
                head = f.read(fmt.BLOCK_HEADER_BYTES)
            if head.startswith(fmt.REGION_MAGIC):
                table = fmt.unpack_header(fmt.REGION_MAGIC, head, f"{dev} region table")
                wids.update(str(r["wid"]) for r in table["regions"] if r["ns"] == digest and r.get("wid"))
    return sorted(wids)


def shard_config(shard: Shard, wid: str | None = None) -> StoreConfig:
    """The config to open ``shard`` (writer ``wid``) offline with: a recorded ``CONFIG``, else one made
    from the namespace header's devices and the segment files' size."""
    for meta in ([shard.meta / writer_dirname(wid)] if wid else []) + [shard.meta]:
        try:
            return load_config(meta)
        except (OSError, ValueError, KVTierError):
            continue
    devices = [str(d) for d in shard.header["devices"]]
    fields: dict[str, Any] = {"devices": devices}
    if shard.meta != Path(devices[0]) / shard.namespace.dirname():
        fields["meta_dir"] = str(shard.meta.parent)
    sizes = [p.stat().st_size for d in devices if Path(d).is_dir()
             for p in (Path(d) / shard.namespace.dirname()).glob(f"{WRITER_PREFIX}*/seg-*.dat")]
    if sizes and max(sizes) >= 1 << 20 and max(sizes) % 4096 == 0:
        fields["segment_bytes"] = max(sizes)
    return StoreConfig.from_mapping(fields)


def rebuild_shard(shard: Shard, wids: list[str] | None = None,
                  progress: ProgressStart | None = None) -> list[WriterRebuild]:
    """Rebuild each writer of ``shard`` (``wids``: only those) from its pages (``store.rebuild``).
    ``progress(label, slots)`` is called as each writer starts and returns its per-read callback.
    A writer that cannot be rebuilt (a live writer holds it, a device is missing) gets its ``error``."""
    done = []
    for wid in wids if wids is not None else writer_ids(shard, shard_config(shard)):
        outcome = WriterRebuild(shard.namespace.describe(), wid)
        try:
            config = shard_config(shard, wid)
            layout = open_layout(config, shard.namespace, shard.meta, wid, create=False)
            try:
                step = None if progress is None else progress(f"{shard.namespace.model} {wid}", slots_to_scan(layout))
                outcome.report = rebuild(config, shard.namespace, layout, progress=step)
            finally:
                layout.close()
        except (KVTierError, OSError) as exc:
            outcome.error = str(exc)
        done.append(outcome)
    return done
