"""The power-loss workload of a shared raw pool (``benchmarks.powerloss``, mode ``raw``).

One pool file (a regular file standing in for a raw NVMe-oF namespace) is formatted for two host slots
(``pool_dev.format_pool``) before the recording starts: that is the durable start. Under the ``Recorder``
(whose root holds the pool file: every O_DIRECT ``os.pwritev`` and ``os.fdatasync`` of its descriptors is
logged) writer A opens as ``host_index`` 0 (and, with ``writers = 2``, writer B as ``host_index`` 1, which
puts pages of its own and reads A's, byte-checked), then puts of 1-4 pages of 8 KiB, deletes, evictions (a
40-page capacity), explicit and interval checkpoints (``checkpoint_interval`` 6 for odd seeds: the A/B
checkpoint areas alternate and the four journal areas rotate several times; 120 and no explicit ones for even
seeds: a generation's records outgrow its area's first block, so a sync rewrites a partly synced block), lease beats (each also beats the host lease),
and the close. After each call the workload marks the pages the writers' own indexes hold.

A cut reopens each writer as its host_index after a reboot (a new ``KVTIER_BOOT_ID``; the host-slot watch
gets an instant clock, so the takeover of its own slot is immediate) and reads every page it indexes.
Cuts are stratified over what each log entry touched (``area_of``: superblock, host lease, region table,
a region's header / LEASE / CONFIG / checkpoint area head or body / journal area head or body / slots; a
sync is classed by the write before it), since every entry names the one file.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.store.crash import key, page_bytes_for
from benchmarks.store.hostpool import HostPool
from benchmarks.store.powerloss_check import held, number, read_back
from sgl_kvtier.config import StoreConfig
from sgl_kvtier.io.powerloss import CutPolicy, Recorder, Recording, build, materialize
from sgl_kvtier.keys import Namespace
from sgl_kvtier.media.shared_raw.regions import regions_of
from sgl_kvtier.media.shared_raw.superblock import format_pool, open_direct, read_superblock
from sgl_kvtier.sharing import shared_raw_claim as pool_claim
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.page_store import PageStore

PAGE = 8192
CAPACITY_PAGES = 40
POOL_BYTES = 8 << 20  # two host shares of 3 MiB: a region (meta areas ~1.1 MiB, 40 slots) fits one
POOL = "pool.img"
BOOT = "KVTIER_BOOT_ID"


def namespace() -> Namespace:
    return Namespace("powerloss-raw", "bf16", "page_first", 16, PAGE)


def interval_for(seed: int) -> int:
    return 120 if seed % 2 == 0 else 6


def config(pool: Path, host: int, durability: str, interval: int = 6) -> StoreConfig:
    """Host ``host``'s writer config: no meta_dir, idle lease threads (beats are the workload's), LRU."""
    return StoreConfig.from_mapping({
        "devices": [str(pool)], "capacity_bytes": CAPACITY_PAGES * fmt.slot_bytes_for(PAGE), "checkpoint_interval": interval,
        "durability": durability, "io_engine": "threads", "io_depth": 1, "heartbeat_s": 600, "dead_after_s": 1800,
        "reclaim_after_s": 3600, "follow_interval_s": 0.0, "host_id": f"pl{host}", "eviction": "lru",
        "sharing": "cluster", "host_index": host})


@contextlib.contextmanager
def booted(boot: str, instant_watch: bool = False) -> Iterator[None]:
    """``KVTIER_BOOT_ID`` = ``boot`` (and, with ``instant_watch``, a host-slot watch whose clock jumps at
    each sleep) for the duration."""
    old_boot, old_watch = os.environ.get(BOOT), pool_claim.DEFAULT_WATCH
    os.environ[BOOT] = boot
    if instant_watch:
        t = [0.0]

        def sleep(s: float) -> None:
            t[0] += s
        pool_claim.DEFAULT_WATCH = pool_claim.HostWatch(lambda: t[0], sleep)
    try:
        yield
    finally:
        pool_claim.DEFAULT_WATCH = old_watch
        if old_boot is None:
            os.environ.pop(BOOT, None)
        else:
            os.environ[BOOT] = old_boot


def new_pool(root: Path) -> Path:
    """A formatted pool file of two host slots in ``root`` (before the recording: the durable start)."""
    pool = root / POOL
    with open(pool, "wb") as f:
        f.truncate(POOL_BYTES)
    format_pool([str(pool)], 2)
    return pool


def workload(root: Path, durability: str, seed: int, writers: int = 1, steps: int = 40,
             recording: Callable[[Path], contextlib.AbstractContextManager[Recorder]] | None = None) -> Recording:
    """Record one seeded raw-pool workload on a fresh pool in ``root`` (see the module docstring).
    ``recording``: ``benchmarks.powerloss.recording`` (or a variant); raises AssertionError if B reads
    a page of A with wrong bytes."""
    if recording is None:
        from benchmarks.powerloss import recording as plain
        recording = plain
    rng = random.Random(seed)
    mem = HostPool(PAGE, 4)
    pool_path, ns = new_pool(root), namespace()
    interval = interval_for(seed)
    with recording(root) as rec:
        rec.mark("interval", interval)
        pools: list[SharedPool] = []
        try:
            for h in range(writers):
                with booted(f"boot-{h}"):
                    pools.append(SharedPool.open_writer(config(pool_path, h, durability, interval), ns))
                rec.mark("state", held(pools))
            fresh = seed * 1000
            for _ in range(steps):
                h = rng.randrange(writers)
                pool, own = pools[h], pools[h].own
                assert own is not None
                r = rng.random()
                if r < 0.6:
                    count = rng.randint(1, 4)
                    for j in range(count):
                        mem.write(j, page_bytes_for(fresh + j, PAGE))
                    pool.put([key(fresh + j) for j in range(count)], [mem.runs(j) for j in range(count)])
                    fresh += count
                elif r < 0.7 and len(own):
                    pool.delete(rng.sample(own.keys(), min(len(own), rng.randint(1, 3))))
                elif r < 0.75 and len(own):
                    pool.evict(rng.sample(own.keys(), 1))
                elif r < 0.83 and interval < 120:
                    pool.checkpoint()
                elif r < 0.93 or writers == 1:
                    if own.lease is not None:
                        own.lease.beat()
                else:  # B reads some of A's pages (a refresh follows A's announced journal)
                    a = pools[0].own
                    assert a is not None
                    for k in rng.sample(a.keys(), min(len(a), 3)):
                        if pools[1].get([k], [mem.runs(0)]) == [True]:
                            assert mem.read(0) == page_bytes_for(number(k), PAGE), f"B read page {number(k)} wrong"
                rec.mark("state", held(pools))
        finally:
            for pool in pools:
                pool.close()
        rec.mark("state", held(pools))
    return rec.recording


# ---------------------------------------------------------------------------------- classes of entries
def area_of(pool: Path) -> Callable[[int], str]:
    """What a write at an offset of ``pool`` touches (the geometry read back after the workload)."""
    fd = open_direct(str(pool), False)
    try:
        sb = read_superblock(fd, str(pool))
        assert sb is not None
        regions = regions_of(fd, sb)
    finally:
        os.close(fd)
    spans: list[tuple[int, int, str]] = [(0, fmt.POOL_BLOCK, "superblock")]
    for h in range(sb.hosts):
        spans += [(sb.slot_at(h), sb.slot_at(h) + 2 * fmt.POOL_BLOCK, f"host-lease {h}"),
                  (sb.slot_at(h) + fmt.HOST_TABLE_AT, sb.slot_at(h) + sb.host_slot_bytes, f"table {h}")]
    for r in regions:
        w = f"h{r.host}"
        spans += [(r.offset, r.at(fmt.REGION_LEASE_AT), f"{w} header"),
                  (r.at(fmt.REGION_LEASE_AT), r.at(fmt.REGION_CONFIG_AT), f"{w} LEASE"),
                  (r.at(fmt.REGION_CONFIG_AT), r.checkpoint_at(0), f"{w} CONFIG"),
                  (r.data_at, r.offset + r.length, f"{w} slots")]
        for i in range(2):
            at = r.checkpoint_at(i)
            spans += [(at, at + fmt.POOL_BLOCK, f"{w} ckpt {i} head"), (at + fmt.POOL_BLOCK, at + r.checkpoint_bytes,
                                                                        f"{w} ckpt {i} body")]
        for i in range(r.journals):
            at = r.journal_at(i)
            spans += [(at, at + fmt.POOL_BLOCK, f"{w} journal {i} head"),
                      (at + fmt.POOL_BLOCK, at + r.journal_bytes, f"{w} journal {i} body")]

    def classify(offset: int) -> str:
        return next((name for lo, hi, name in spans if lo <= offset < hi), "other")
    return classify


def op_classes(rec: Recording, classify: Callable[[int], str]) -> list[str]:
    """Per log entry: ``write <area>``, ``fdatasync after <area>`` (the last write's), else ``op_class``."""
    out, last = [], "start"
    for i, e in enumerate(rec.entries):
        if e.kind == "write" and e.path.endswith(POOL):
            last = classify(e.offset)
            out.append(f"write {last}")
        elif e.kind == "sync" and e.path.endswith(POOL):
            out.append(f"{e.name} after {last}")
        else:
            out.append(rec.op_class(i))
    return out


def raw_cuts(rec: Recording, classes: list[str], n: int, rng: random.Random) -> list[int]:
    """``stratified_cuts`` over ``classes``: the first and last cut, then round-robin over the classes."""
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(rec.entries):
        if e.kind != "mark":
            groups.setdefault(classes[i], []).append(i + 1)
    for positions in groups.values():
        rng.shuffle(positions)
    chosen = [len(rec.entries), 0][:n]
    while len(chosen) < min(n, len(rec.entries) + 1) and any(groups.values()):
        for cls in sorted(groups):
            if groups[cls] and len(chosen) < n and (pos := groups[cls].pop()) not in chosen:
                chosen.append(pos)
    return sorted(chosen)


# ---------------------------------------------------------------------------------------------- a cut
def check_cut(rec: Recording, cut: int, policy: CutPolicy, rng: random.Random, scratch: Path, durability: str,
              writers: int, classes: list[str], result_type: Callable[..., Any], must: set[int]) -> Any:
    """Build the state of one cut, reopen every host's writer after a reboot, read every page it indexes."""
    dest = materialize(build(rec, cut, policy, rng), scratch / f"cut-{cut}")
    interval = next(e.payload for _, e in rec.marks() if e.label == "interval")
    ops = [i for i in range(cut) if rec.entries[i].kind != "mark"]
    result = result_type(cut, str(policy), classes[ops[-1]] if ops else "start")
    result.acked = len(must)

    def opener(h: int) -> PageStore:
        with booted(f"reboot-{cut}-{h}", instant_watch=True):
            return open_writer(config(dest / POOL, h, durability, interval), namespace())
    return read_back(result, [partial(opener, h) for h in range(writers)], must, dest, PAGE)
