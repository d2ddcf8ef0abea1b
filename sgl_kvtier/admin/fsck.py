"""Offline inspection and verification of stores, for ``sgl-kvtier inspect`` and ``sgl-kvtier fsck``.

``find_shards(path)`` finds the namespace shards under a directory device or meta dir, a raw device's region
table, or a shared raw pool's host tables (every host's writers). ``fsck`` reads every indexed page of a
writer (``fsck_pool``: every writer, each opened read-only) against its checksum and reports journal or
checkpoint damage; nothing on disk changes unless ``repair``, which opens a damaged writer as that writer
(recovery folds the readable journal into a fresh checkpoint) and journals failing pages as deleted, but
only a writer of this host whose ``LOCK`` is free (``open_writer_at``); any other is reported skipped.
``rebuild_shard`` (``fsck --rebuild``, not on a shared raw pool) rebuilds each writer's index from its pages
(``admin.rebuild``) under its ``LOCK``, with its recorded ``CONFIG`` or the header's devices.
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sgl_kvtier.admin.rebuild import RebuildReport, rebuild, slots_to_scan
from sgl_kvtier.config import Sharing, StoreConfig
from sgl_kvtier.errors import KVTierError, StoreFormatError, StoreLockedError
from sgl_kvtier.io.buffers import AlignedBuffer
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.media.shared_raw.regions import pool_namespaces
from sgl_kvtier.media.shared_raw.superblock import superblock_of
from sgl_kvtier.sharing import sites
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.sharing.lease import read_lease
from sgl_kvtier.sharing.pool_status import DEAD, UNKNOWN, pool_summary, state_of
from sgl_kvtier.sharing.writers import writer_dirs
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.devices import is_block_like
from sgl_kvtier.store.format import WRITER_PREFIX, writer_dirname
from sgl_kvtier.store.meta import LEASE
from sgl_kvtier.store.page_store import PageStore

VERIFY_BATCH = 32
_WID = re.compile(r"([A-Za-z0-9._]{1,64})-([0-9]+)")


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
    wid: str | None = None  # the writer verified
    pages_checked: int = 0
    bad_pages: list[str] = field(default_factory=list)  # hex keys
    problems: list[str] = field(default_factory=list)  # journal / checkpoint damage
    repaired: bool = False
    skipped: str | None = None  # why ``repair`` left a damaged writer alone (live, another host, index lost)
    # The writer's index misses pages its slots still hold (checkpoint unreadable, or journal and checkpoint
    # gone): ``repair`` would fold the loss into a fresh checkpoint; ``fsck --rebuild`` finds them again.
    index_incomplete: bool = False

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
    elif p.exists() and is_block_like(path) and superblock_of(path) is not None:  # a shared raw pool
        return [Shard(meta, Namespace.from_mapping(header["namespace"]), header)
                for meta, header in pool_namespaces(path) or []]
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


def open_shard(shard: Shard, wid: str | None = None) -> PageReader:
    """A read-only view of writer ``wid`` of ``shard`` (None: the lowest), with the config that writer
    recorded (changes nothing on disk)."""
    return PageReader.open(shard_config(shard, wid), shard.namespace, wid=wid)


def open_writer(shard: Shard) -> PageStore:
    """``shard``'s writer (takes its lock; recovery folds the journal into a new checkpoint)."""
    return sites.open_writer(sites.load_config(shard.meta), shard.namespace)


def open_writer_at(shard: Shard, wid: str) -> PageStore:
    """Open writer directory ``w-<wid>`` of ``shard`` as its writer (recovery folds its journal into a new
    checkpoint). Raises StoreLockedError when its lock is held (or was taken meanwhile).

    A writer claims the lowest free ``w-<host>-<k>`` (``sharing.writers``), so the directories below ``k``
    are held here for the instant of the open (a shared-nothing ``flock``; one missing is made and
    removed again), and the claim lands on ``k`` unless a writer took it meanwhile."""
    match = _WID.fullmatch(wid)
    if match is None:
        raise StoreLockedError(f"{wid}: not a writer id of the form <host>-<k>")
    host, k = match.group(1), int(match.group(2))
    if shard_config(shard, wid).host_index is not None:  # a shared raw pool: that region, by wid
        return sites.open_writer(shard_config(shard, wid), shard.namespace, wid=wid)
    config = replace(shard_config(shard, wid), host_id=host, sharing=Sharing.HOST)
    held: list[tuple[int, Path | None]] = []
    try:
        for j in range(k):
            held.append(_hold(shard.meta / writer_dirname(f"{host}-{j}")))
        store = sites.open_writer(config, shard.namespace)
    finally:
        for fd, made in held:
            if fd >= 0:
                os.close(fd)  # drops the lock
            if made is not None:
                (made / "LOCK").unlink(missing_ok=True)
                made.rmdir()
    if store.wid != wid:
        store.close()
        raise StoreLockedError(f"{shard.meta / writer_dirname(wid)}: taken by a writer meanwhile")
    return store


def _hold(path: Path) -> tuple[int, Path | None]:
    """Lock ``path/LOCK`` so that a claim skips it: (fd, or -1 where a live writer holds it; the
    directory if it was made here)."""
    made = None
    if not path.is_dir():
        path.mkdir(mode=0o700)
        made = path
    fd = os.open(path / "LOCK", os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -1, made  # held by a live writer: the claim skips it anyway
    return fd, made


def fsck(shard: Shard, repair: bool = False, progress: Callable[[int], object] | None = None,
         wid: str | None = None) -> FsckReport:
    """Verify every page and the journal of writer ``wid`` of ``shard`` (None: the lowest); with
    ``repair``, drop what is bad as that writer, if its lock is free (else ``skipped`` says why).
    ``progress`` is called with the number of pages checked after each batch."""
    report = FsckReport(shard.namespace.describe(), str(shard.meta))
    # ``with``: an error of the body is the one raised; a failing close rides along as its note.
    with open_shard(shard, wid) as store:
        report.wid = store.wid
        lost = _index_lost(shard, store.wid)
        report.problems = list(store.recovery.problems) + lost
        report.index_incomplete = store.recovery.checkpoint_unreadable or bool(lost)
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
        _repair(shard, report)
    return report


def _index_lost(shard: Shard, wid: str) -> list[str]:
    """The refusal a writer would meet at open because its journal and checkpoint are gone while its slots
    still hold pages (``store.layout.check_meta_present``), as a problem: such a writer reads as empty,
    yet only ``fsck --rebuild`` brings its pages back."""
    config = shard_config(shard, wid)
    try:
        sites.site_for(config).check_meta_present(shard.namespace, shard.meta / writer_dirname(wid), wid)
    except StoreFormatError as exc:
        return [str(exc)]
    return []


def _not_here(shard: Shard, wid: str) -> str | None:
    """Why writer ``wid`` of ``shard`` must not be rewritten from this host (its lease names another host,
    whose writer this host cannot see through ``flock``), or None."""
    path = shard.meta / writer_dirname(wid)
    lease = read_lease(path / LEASE)
    if lease is not None and state_of(path, lease, shard_config(shard, wid)) == UNKNOWN:
        return f"writer {wid} belongs to host {lease.get('host_id')}: run this on that host"
    return None


def _repair(shard: Shard, report: FsckReport) -> None:
    assert report.wid is not None
    if report.index_incomplete:
        report.skipped = (f"writer {report.wid}'s index misses pages its slots hold; repairing would drop them: "
                          f"run `sgl-kvtier fsck --rebuild {shard.meta.parent}`")
        return
    path = shard.meta / writer_dirname(report.wid)
    config = shard_config(shard, report.wid)
    state = state_of(path, read_lease(path / LEASE), config)
    if state != DEAD:
        report.skipped = f"writer {report.wid} is {state}" + ("" if state == "live" else " (another host)")
        return
    try:
        writer = open_writer_at(shard, report.wid)
    except StoreLockedError as exc:
        report.skipped = str(exc)
        return
    with writer:  # recovery folded the journal and dropped torn tails
        writer.delete([PageKey(bytes.fromhex(k)) for k in report.bad_pages])
    report.repaired = True


def fsck_pool(shard: Shard, repair: bool = False,
              progress: Callable[[str, int], Callable[[int], object]] | None = None) -> list[FsckReport]:
    """``fsck`` of every writer directory of ``shard``, in wid order. ``progress(label, pages)`` is
    called as each writer starts and returns its per-batch callback."""
    reports = []
    for wid, _ in writer_dirs(shard.meta):
        try:
            step = None
            if progress is not None:
                with open_shard(shard, wid) as view:
                    step = progress(f"{shard.namespace.model} {wid}", len(view))
            reports.append(fsck(shard, repair, step, wid))
        except (KVTierError, OSError) as exc:  # a directory being made, or damaged beyond opening
            reports.append(FsckReport(shard.namespace.describe(), str(shard.meta), wid,
                                      problems=[f"writer {wid} not readable: {exc}"]))
    return reports


def shard_summary(shard: Shard) -> dict[str, Any]:
    """What ``sgl-kvtier inspect`` shows of ``shard``'s pool (JSON-ready, ``sharing.pool_status``), read
    without changing anything."""
    return pool_summary(shard.meta, shard.namespace, shard.header, lambda wid: shard_config(shard, wid))


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
            return sites.load_config(meta)
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
    """Rebuild each writer of ``shard`` (``wids``: only those) from its pages (``admin.rebuild``).
    ``progress(label, slots)`` is called as each writer starts and returns its per-read callback.
    A writer that cannot be rebuilt (a live writer holds it, a device is missing) gets its ``error``."""
    if superblock_of(str(shard.meta.parent)) is not None:
        return [WriterRebuild(shard.namespace.describe(), wid, error="fsck --rebuild is not available for a shared "
                                                                     "raw pool yet (fsck and fsck --repair are)")
                for wid in wids or [w for w, _ in writer_dirs(shard.meta)]]
    done = []
    for wid in wids if wids is not None else writer_ids(shard, shard_config(shard)):
        outcome = WriterRebuild(shard.namespace.describe(), wid, error=_not_here(shard, wid))
        if outcome.error is not None:
            done.append(outcome)
            continue
        try:
            config = shard_config(shard, wid)
            layout = sites.site_for(config).open_layout(shard.namespace, shard.meta, wid, create=False)
            try:
                step = None if progress is None else progress(f"{shard.namespace.model} {wid}", slots_to_scan(layout))
                outcome.report = rebuild(config, shard.namespace, layout, progress=step,
                                         parts=shard.header.get("parts"))  # the header's, as the writer made them
            finally:
                layout.close()
        except (KVTierError, OSError) as exc:
            outcome.error = str(exc)
        done.append(outcome)
    return done
