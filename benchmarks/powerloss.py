"""Power-loss suite: record a store workload, cut the power at many points, check what a reopen serves.

    python -m benchmarks.powerloss --cuts 1000              # the long suite (the fast one is in tests/)
    python -m benchmarks.powerloss --cuts 100 --modes batch

Each run records one seeded workload under ``sgl_kvtier.io.powerloss.Recorder`` (one writer, or two
writers on one pool through ``SharedPool.open_writer``): first open (headers, writer directories,
CONFIG, journal, lease), puts of 1-4 pages of 56 KiB, deletes, evictions (a 40-page capacity), explicit
and interval checkpoints (every 12 records), segment creation (1 MiB segments: 17 slots each), lease
beats, and the close. After every call the workload marks which pages the index holds. Then, for cuts
spread over every kind of operation in the log (``stratified_cuts``) under random ``CutPolicy``s (unsynced
data dropped, kept, torn at 512 B / 4 KiB, or reordered; unsynced directory entries dropped, kept, or a
prefix), it builds the surviving tree, reopens the store there and reads every page it indexes.

Per cut: pages checked (served), wrong bytes (a served page whose bytes differ: must be 0 in every
mode), acknowledged pages lost (pages acknowledged before the cut and not removed by the call the cut
interrupts, that the reopened store does not hold: must be 0 under ``batch``/``always``; ``none``
promises nothing here) and refused opens (an open that raises after a legal cut: must be 0). A cut
inside call ``i`` needs ``S[i-1] & S[i]``, the pages held both before and after that call.
Prints a table per durability mode and writes ``benchmarks/results/powerloss.json``.

Layout ``raw`` (``--layouts raw``; ``benchmarks.store.powerloss_raw``): the same checks on a shared raw pool,
one pool file under the recorded root, one writer (or two, of host_index 0 and 1, the second also reading
the first's pages), every lease, config, checkpoint and journal in the writers' regions on the device
(O_DIRECT + fdatasync), ``checkpoint_interval`` 6 so the journal areas rotate; each cut reopens every host
after a reboot. Its figures are under ``"raw"`` in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import random
import shutil
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

from rich.table import Table

from benchmarks.common import REPO, RESULTS, make_console, progress, scratch_dir, write_json
from benchmarks.store import powerloss_raw as raw
from benchmarks.store.crash import key, page_bytes_for
from benchmarks.store.hostpool import HostPool
from benchmarks.store.powerloss_check import held, read_back
from sgl_kvtier.config import StoreConfig
from sgl_kvtier.io.powerloss import CutPolicy, Recorder, Recording, build, materialize, random_policy, stratified_cuts
from sgl_kvtier.keys import Namespace
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import holes

PAGE = 56 * 1024  # halves of 28 KiB: aligned runs, so pages go straight from host memory (O_DIRECT where it works)
CAPACITY_PAGES = 40  # evictions, and three 1 MiB segments of 17 slots
MODES = ("batch", "always", "none")
LAYOUTS = ("dir", "raw")


def namespace() -> Namespace:
    return Namespace("powerloss", "bf16", "page_first", 16, PAGE)


def config(root: Path, durability: str, **keys: Any) -> StoreConfig:
    """A small deterministic store: one IO in flight, no lease beats but the explicit ones, LRU eviction."""
    mapping = {"devices": [str(root)], "capacity_bytes": CAPACITY_PAGES * fmt.slot_bytes_for(PAGE),
               "segment_bytes": 1 << 20, "checkpoint_interval": 12, "durability": durability,
               "io_engine": "threads", "io_depth": 1, "heartbeat_s": 600, "host_id": "pl", "eviction": "lru",
               **keys}
    return StoreConfig.from_mapping(mapping)


@contextlib.contextmanager
def recording(root: Path, direct_durable: bool = False) -> Iterator[Recorder]:
    """A ``Recorder`` on ``root`` that also logs the holes the store punches through libc."""
    rec = Recorder(root, direct_durable=direct_durable)
    real_punch = holes.punch

    def punch(fd: int, offset: int, length: int) -> bool:
        done = real_punch(fd, offset, length)
        if done:
            rec.zeroed(fd, offset, length)
        return done

    holes.punch = punch  # type: ignore[assignment]
    try:
        with rec:
            yield rec
    finally:
        holes.punch = real_punch  # type: ignore[assignment]


def workload(root: Path, durability: str, seed: int, writers: int = 1, steps: int = 40) -> Recording:
    """Record one seeded workload on a fresh store in ``root`` (see the module docstring)."""
    rng = random.Random(seed)
    mem = HostPool(PAGE, 4)
    cfg, ns = config(root, durability), namespace()
    with recording(root) as rec:
        pools: list[SharedPool] = []
        try:
            for _ in range(writers):
                pools.append(SharedPool.open_writer(cfg, ns))
                rec.mark("state", held(pools))
            fresh = seed * 1000
            for _ in range(steps):
                pool = pools[rng.randrange(writers)]
                own = pool.own
                assert own is not None
                r = rng.random()
                if r < 0.7:
                    count = rng.randint(1, 4)
                    for j in range(count):
                        mem.write(j, page_bytes_for(fresh + j, PAGE))
                    pool.put([key(fresh + j) for j in range(count)], [mem.runs(j) for j in range(count)])
                    fresh += count
                elif r < 0.8 and len(own):
                    pool.delete(rng.sample(own.keys(), min(len(own), rng.randint(1, 3))))
                elif r < 0.85 and len(own):
                    pool.evict(rng.sample(own.keys(), 1))
                elif r < 0.93:
                    pool.checkpoint()
                elif own.lease is not None:
                    own.lease.beat()
                rec.mark("state", held(pools))
        finally:
            for pool in pools:
                pool.close()
        rec.mark("state", held(pools))
    return rec.recording


def must_have(rec: Recording, cut: int) -> set[int]:
    """The acknowledged pages a cut before ``cut`` may not lose: held before and after the call it interrupts."""
    states = [(i, set(e.payload)) for i, e in rec.marks() if e.label == "state"]
    before = [s for i, s in states if i < cut]
    after = [s for i, s in states if i >= cut]
    if not before:
        return set()
    return before[-1] & after[0] if after else before[-1]


@dataclasses.dataclass
class CutResult:
    cut: int
    policy: str
    op: str
    pages_checked: int = 0
    wrong_bytes: int = 0
    acked_lost: int = 0
    acked: int = 0
    refused: str = ""


def check_cut(rec: Recording, cut: int, policy: CutPolicy, rng: random.Random, scratch: Path, durability: str,
              writers: int = 1) -> CutResult:
    """Build the state of one cut under ``scratch``, reopen it with ``writers`` writers, read every page."""
    dest = materialize(build(rec, cut, policy, rng), scratch / f"cut-{cut}")
    ops = [i for i in range(cut) if rec.entries[i].kind != "mark"]
    op = rec.op_class(ops[-1]) if ops else "start"
    result = CutResult(cut, str(policy), op)
    must = must_have(rec, cut) if durability != "none" else set()
    result.acked = len(must)
    openers = [partial(open_writer, config(dest, durability), namespace()) for _ in range(writers)]
    return read_back(result, openers, must, dest, PAGE)


def run_suite(scratch: Path, durability: str, seed: int, cuts: int, writers: int = 1, cuts_per_run: int = 25,
              policy: CutPolicy | None = None, layout: str = "dir") -> list[CutResult]:
    """``cuts`` cuts over ``ceil(cuts / cuts_per_run)`` recorded workloads (seeds from ``seed``); ``layout``
    ``raw``: the shared raw pool workload (``benchmarks.store.powerloss_raw``)."""
    rng = random.Random(seed)
    results: list[CutResult] = []
    run = 0
    while len(results) < cuts:
        root = scratch / f"run-{layout}-{durability}-{writers}-{run}"
        root.mkdir(parents=True)
        n = min(cuts_per_run, cuts - len(results))
        if layout == "raw":
            rec = raw.workload(root, durability, rng.randrange(1, 1 << 20), writers=writers)
            classes = raw.op_classes(rec, raw.area_of(root / raw.POOL))
            for cut in raw.raw_cuts(rec, classes, n, rng):
                must = must_have(rec, cut) if durability != "none" else set()
                results.append(raw.check_cut(rec, cut, policy or random_policy(rng), rng, scratch, durability, writers,
                                             classes, CutResult, must))
        else:
            rec = workload(root, durability, rng.randrange(1, 1 << 20), writers=writers)
            for cut in stratified_cuts(rec, n, rng):
                results.append(check_cut(rec, cut, policy or random_policy(rng), rng, scratch, durability, writers))
        shutil.rmtree(root, ignore_errors=True)
        run += 1
    return results


def summarize(results: list[CutResult]) -> dict[str, Any]:
    refused = [r for r in results if r.refused]
    return {"cuts": len(results), "op_classes": len({r.op for r in results}),
            "pages_checked": sum(r.pages_checked for r in results),
            "wrong_bytes": sum(r.wrong_bytes for r in results),
            "acked_pages": sum(r.acked for r in results),
            "acked_lost": sum(r.acked_lost for r in results),
            "cuts_losing_acked": sum(r.acked_lost > 0 for r in results),
            "refused_opens": len(refused),
            "first_findings": [dataclasses.asdict(r) for r in results if r.refused or r.acked_lost or r.wrong_bytes][:5]}


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """``name``'s logger at CRITICAL inside the block, its own level again after."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cuts", type=int, default=1000, help="cuts per durability mode (each half one, half two writers)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                   help="dir: writer directories on a filesystem; raw: a shared raw pool (meta on the device)")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--dir", type=Path, default=REPO / ".bench-powerloss", help="scratch directory (removed afterwards)")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory of powerloss.json")
    args = p.parse_args(argv)
    console = make_console()
    by_layout: dict[str, dict[str, dict[str, Any]]] = {layout: {} for layout in args.layouts}
    start = time.monotonic()
    # torn pages dropped on reopen are expected: quiet for the run, the caller's level restored after (tests)
    with quiet_logger("sgl_kvtier"), scratch_dir(args.dir, "powerloss-") as work, progress(console) as bars:
        for layout, rows in by_layout.items():
            for mode in args.modes:
                task = bars.add_task(f"cuts ({layout} {mode})", total=args.cuts)
                results = []
                for writers, n in ((1, args.cuts - args.cuts // 2), (2, args.cuts // 2)):
                    results += run_suite(work, mode, args.seed + writers, n, writers, layout=layout)
                    bars.advance(task, n)
                rows[mode] = summarize(results)
    table = Table(title=f"power loss: {args.cuts} cuts per mode (seed {args.seed})")
    columns = ("cuts", "op_classes", "pages_checked", "wrong_bytes", "acked_pages", "acked_lost", "refused_opens")
    table.add_column("layout")
    table.add_column("durability")
    for c in columns:
        table.add_column(c.replace("_", " "), justify="right")
    for layout, rows in by_layout.items():
        for mode, row in rows.items():
            table.add_row(layout, mode, *(str(row[c]) for c in columns))
    console.print(table)
    for layout, rows in by_layout.items():
        for mode, row in rows.items():
            for finding in row["first_findings"]:
                console.print(f"[{layout} {mode}] {finding}", markup=False, highlight=False)
    seconds = round(time.monotonic() - start, 1)
    console.print(f"{seconds} s")
    write_json(args.out / "powerloss.json", {"seed": args.seed, "cuts_per_mode": args.cuts, "seconds": seconds,
                                             "modes": by_layout.get("dir", {}), "raw": by_layout.get("raw", {})})
    bad = any(r["wrong_bytes"] or r["refused_opens"] or (m != "none" and r["acked_lost"])
              for rows in by_layout.values() for m, r in rows.items())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
