"""Offline view of one namespace's pool, for ``sgl-kvtier inspect``: every writer, read without writing.

Per writer: its lease (``sharing.lease.read_lease``: host, pid, beats, heartbeat, journal cursor, leased
``bytes_used``); the lease age from the LEASE file's mtime (the lease holds no wall-clock time; another
host's mtime is that host's or the file server's clock); its state, ``live`` / ``dead`` on this host
(``writers.writer_alive``: an instant's shared ``flock`` on its LOCK) or ``unknown`` for another host's (a
lease naming this ``machine_id`` is this host's whatever ``host_id`` it used); the ``sharing`` mode its
CONFIG records; its pages and bytes from its own index through a read-only ``PageReader``, else its last
lease's figures (``source`` says which). A writer with no lease (``sharing = "off"`` beats none) is judged by
its LOCK alone, and a live one's pid is the one its LOCK records. The pool's capacity is the largest
``capacity_bytes`` the writers recorded (each caps the pool's total at its own), else what the devices hold
(a reader's stats); ``share_pct`` is a writer's bytes over it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import KVTierError
from sgl_kvtier.keys import Namespace
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.sharing.lease import read_lease
from sgl_kvtier.sharing.writers import host_id, lock_holder, machine_id, recorded_sharing, writer_alive, writer_dirs
from sgl_kvtier.store.meta import LEASE

LIVE, DEAD, UNKNOWN = "live", "dead", "unknown"
LEASE_AGE_FROM = "LEASE mtime"
STALE_BEATS = 3  # another host's lease older than this many heartbeats is flagged stale
ConfigOf = Callable[[str], StoreConfig]  # wid -> the config to open that writer offline with


@dataclass
class WriterView:
    """One writer of a pool as ``inspect`` shows it (JSON-ready through ``asdict``)."""

    wid: str
    host: str | None
    pid: int | None
    state: str  # LIVE, DEAD or UNKNOWN (a writer of another host)
    lease_age_s: float | None  # seconds since the LEASE file's mtime; None: no lease file
    lease_stale: bool  # another host's lease older than STALE_BEATS heartbeats
    beats: int | None  # beats written (the lease's counter + 1)
    heartbeat_s: float | None
    pages: int
    bytes_used: int
    source: str  # "index" (its checkpoint + journals) or "lease" (the index could not be read)
    leased_bytes_used: int | None  # what its last beat published (the pool-wide cap counts this)
    capacity_bytes: int | None  # its configured cap (CONFIG), None when unlimited or unreadable
    journal: list[int] | None  # the lease's journal cursor [generation, bytes]
    share_pct: float | None = None  # bytes_used over the pool's capacity, percent
    sharing: str | None = None  # the mode its CONFIG records ("off": a sole writer, which has no lease)
    problems: list[str] = field(default_factory=list)


def state_of(path: Path, lease: dict[str, Any] | None, config: StoreConfig) -> str:
    """LIVE / DEAD / UNKNOWN for the writer of directory ``path`` seen from this host (module docstring)."""
    here = host_id(replace(config, host_id=None))  # the hostname's id, whatever the writer configured
    if lease is not None and lease.get("machine_id") and lease.get("machine_id") == machine_id():
        here = str(lease.get("host_id", here))  # this machine, under an explicit host_id
    alive = writer_alive(path, lease, here)
    return UNKNOWN if alive is None else LIVE if alive else DEAD


def lease_age(path: Path, now: float | None = None) -> float | None:
    """Seconds since writer directory ``path``'s LEASE was last written (its mtime); None without one."""
    try:
        mtime = (path / LEASE).stat().st_mtime
    except OSError:
        return None
    return max(0.0, (time.time() if now is None else now) - mtime)


def writer_view(namespace: Namespace, wid: str, path: Path, config_of: ConfigOf,
                now: float | None = None) -> tuple[WriterView, dict[str, Any]]:
    """Writer ``wid`` (directory ``path``) as ``inspect`` shows it, and what its reader reported of the
    store (devices, direct_io; {} when it could not be opened)."""
    lease = read_lease(path / LEASE)
    problems: list[str] = []
    config: StoreConfig | None = None
    try:
        config = config_of(wid)
    except (KVTierError, OSError, ValueError) as exc:
        problems.append(f"config: {exc}")
    age = lease_age(path, now)
    state = UNKNOWN if config is None else state_of(path, lease, config)
    heartbeat = None if lease is None else float(lease.get("heartbeat_s", 0.0))
    store: dict[str, Any] = {}
    pages, used, source = int((lease or {}).get("pages", 0)), int((lease or {}).get("bytes_used", 0)), "lease"
    if config is not None:
        try:
            with PageReader.open(config, namespace, wid=wid) as reader:
                stats = reader.stats()
                pages, used, source = stats.pages, stats.bytes_used, "index"
                store = {"devices": stats.devices, "direct_io": stats.direct_io, "capacity_bytes": stats.capacity_bytes}
                problems += list(reader.recovery.problems)
        except (KVTierError, OSError) as exc:
            problems.append(f"index not readable: {exc}")
    journal = None if lease is None else [int(v) for v in lease.get("journal", [])] or None
    pid, mode = _int(lease, "pid"), recorded_sharing(path)
    if pid is None and state == LIVE:
        holder = lock_holder(path)  # no lease (sharing = "off"): the pid its LOCK records
        pid = int(holder) if holder.isdigit() else None
    view = WriterView(
        wid=wid, host=None if lease is None else str(lease.get("host_id")), pid=pid, state=state,
        lease_age_s=age, beats=None if lease is None else int(lease.get("counter", 0)) + 1, heartbeat_s=heartbeat,
        lease_stale=bool(state == UNKNOWN and age is not None and heartbeat and age > STALE_BEATS * heartbeat),
        pages=pages, bytes_used=used, source=source, leased_bytes_used=_int(lease, "bytes_used"),
        capacity_bytes=None if config is None else config.capacity_bytes, journal=journal, problems=problems,
        sharing=None if mode is None else mode.value)
    if view.host is None:
        view.host = wid.rpartition("-")[0] or None  # no lease yet: the wid names the host
    return view, store


def _int(lease: dict[str, Any] | None, name: str) -> int | None:
    value = None if lease is None else lease.get(name)
    return None if value is None else int(value)


def pool_summary(meta: Path, namespace: Namespace, header: dict[str, Any], config_of: ConfigOf,
                 now: float | None = None) -> dict[str, Any]:
    """The pool of the namespace in ``meta`` (JSON-ready): its totals and one row per writer.

    Keys: namespace, digest, meta, format_version, pages, bytes_used, capacity_bytes, writers_live,
    writers_dead, writers_unknown, writers (``WriterView`` dicts), devices, direct_io, problems (every
    writer's, prefixed with its wid), locked_by_writer (the pid of the first live writer, or None)."""
    now = time.time() if now is None else now
    views: list[WriterView] = []
    store: dict[str, Any] = {}
    for wid, path in writer_dirs(meta):
        view, seen = writer_view(namespace, wid, path, config_of, now)
        views.append(view)
        store = store or seen
    capacity = _pool_capacity(views, store)
    for v in views:
        v.share_pct = None if not capacity else round(100.0 * v.bytes_used / capacity, 2)
    live = [v for v in views if v.state == LIVE]
    return {
        "namespace": namespace.describe(), "digest": namespace.digest().hex(), "meta": str(meta),
        "format_version": header.get("format_version"),
        "pages": sum(v.pages for v in views), "bytes_used": sum(v.bytes_used for v in views),
        "capacity_bytes": capacity,
        "writers_live": len(live), "writers_dead": sum(v.state == DEAD for v in views),
        "writers_unknown": sum(v.state == UNKNOWN for v in views),
        "lease_age_from": LEASE_AGE_FROM,
        "writers": [asdict(v) for v in views],
        "devices": store.get("devices", [str(d) for d in header.get("devices", [])]),
        "direct_io": store.get("direct_io"),
        "problems": [f"{v.wid}: {p}" for v in views for p in v.problems],
        "locked_by_writer": live[0].pid if live and live[0].pid is not None else (-1 if live else None),
    }


def _pool_capacity(views: list[WriterView], store: dict[str, Any]) -> int | None:
    configured = [v.capacity_bytes for v in views if v.capacity_bytes is not None]
    if configured:
        return max(configured)
    return store.get("capacity_bytes")  # unlimited: what the devices hold
