"""Long reliability suites for the page store (the fast versions run in the test suite).

    python -m benchmarks.reliability crash --kills 1000       # SIGKILL a writer at random points
    python -m benchmarks.reliability corrupt --faults 10000   # flip bits, zero blocks, truncate files

crash: a writer process (benchmarks/store/crash_writer.py) puts seeded pages under ``batch`` or ``always``
durability, with small checkpoint intervals and a capacity that forces eviction, and is killed with SIGKILL
after a random number of acknowledged batches. Each reopen checks every served page byte for byte and
that the newest acknowledged pages (those eviction cannot have taken) survived.
corrupt: rounds of: populate a store, inject faults anywhere in its files, reopen, read every page.
Both print a table and write JSON to benchmarks/results/; "wrong bytes served" must be 0.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.common import REPO, RESULTS, make_console, progress, scratch_dir, write_json
from benchmarks.machine import machine_info, machine_line
from benchmarks.store.crash import CAPACITY, PAGE, check_store, key, open_small, run_and_kill
from benchmarks.store.hostpool import HostPool
from sgl_kvtier.errors import KVTierError


def crash(args: argparse.Namespace, work: Path, console: Console) -> dict:
    rng = random.Random(args.seed)
    root = work / "crash-store"
    root.mkdir()
    totals = {"kills": 0, "pages_checked": 0, "wrong_bytes": 0, "acked_pages_lost": 0, "acked_pages": 0}
    start = time.monotonic()
    with progress(console) as bars:
        task = bars.add_task("SIGKILL rounds", total=args.kills)
        for _ in range(args.kills):
            durability = rng.choice(["batch", "always"])
            acked, _ = run_and_kill(root, rng.randrange(1 << 30), durability, rng.randrange(1, 30))
            newest = sorted(acked)[-(CAPACITY // 2):]
            checked, wrong, lost = check_store(root, newest)
            totals["kills"] += 1
            totals["pages_checked"] += checked
            totals["wrong_bytes"] += wrong
            totals["acked_pages_lost"] += lost
            totals["acked_pages"] += len(newest)
            bars.advance(task)
    totals["seconds"] = round(time.monotonic() - start, 1)
    return totals


def inject(files: list[Path], rng: np.random.Generator, n: int) -> dict[str, int]:
    """``n`` faults: most in page data (segments), one in ten in metadata (journal, checkpoint, headers)."""
    kinds = {"bit_flip": 0, "zeroed_4k": 0, "truncated": 0}
    data_files = [f for f in files if f.suffix == ".dat"]
    meta_files = [f for f in files if f.suffix != ".dat"]
    for _ in range(n):
        pool = meta_files if rng.random() < 0.1 or not data_files else data_files
        target = pool[rng.integers(len(pool))]
        data = bytearray(target.read_bytes())
        if not data:
            continue
        kind = ("bit_flip", "zeroed_4k", "truncated")[int(rng.choice(3, p=[0.6, 0.3, 0.1]))]
        if kind == "bit_flip":
            data[rng.integers(len(data))] ^= 1 << int(rng.integers(8))
        elif kind == "zeroed_4k":
            at = int(rng.integers(len(data))) // 4096 * 4096
            data[at:at + 4096] = bytes(len(data[at:at + 4096]))
        else:
            data = data[:int(rng.integers(len(data)))]
        target.write_bytes(bytes(data))
        kinds[kind] += 1
    return kinds


def corrupt(args: argparse.Namespace, work: Path, console: Console) -> dict:
    rng = np.random.default_rng(args.seed)
    totals = {"faults": 0, "rounds": 0, "pages_written": 0, "pages_served": 0, "wrong_bytes": 0,
              "refused_opens": 0, "bit_flip": 0, "zeroed_4k": 0, "truncated": 0}
    per_round, n_pages = 10, 32
    start = time.monotonic()
    with progress(console) as bars:
        task = bars.add_task("injected faults", total=args.faults)
        while totals["faults"] < args.faults:
            path = work / f"corrupt-{totals['rounds']}"
            path.mkdir()
            mem = HostPool(PAGE, n_pages, np.random.default_rng(int(rng.integers(1 << 30))))
            truth = {n: mem.read(n) for n in range(n_pages)}
            with open_small(path, capacity_pages=64, checkpoint_interval=16) as store:
                for first in range(0, n_pages, 8):  # several batches: journal + checkpoints on disk
                    store.put([key(n) for n in range(first, first + 8)], [mem.runs(n) for n in range(first, first + 8)])
            files = [p for p in sorted(path.glob("ns-*/**/*")) if p.is_file() and p.name != "LOCK"]
            for kind, count in inject(files, rng, per_round).items():
                totals[kind] += count
            try:
                with open_small(path, capacity_pages=64) as store:
                    mem.clear()
                    got = store.get([key(n) for n in range(n_pages)], [mem.runs(n) for n in range(n_pages)])
                    for n, ok in enumerate(got):
                        if ok:
                            totals["pages_served"] += 1
                            totals["wrong_bytes"] += mem.read(n) != truth[n]
            except KVTierError:
                totals["refused_opens"] += 1  # a destroyed header is refused with a clear error
            totals["faults"] += per_round
            totals["rounds"] += 1
            totals["pages_written"] += n_pages
            bars.advance(task, per_round)
            shutil.rmtree(path)
    totals["seconds"] = round(time.monotonic() - start, 1)
    return totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="suite", required=True)
    c = sub.add_parser("crash")
    c.add_argument("--kills", type=int, default=1000)
    k = sub.add_parser("corrupt")
    k.add_argument("--faults", type=int, default=10_000)
    for s in (c, k):
        s.add_argument("--seed", type=int, default=2026)
        s.add_argument("--dir", type=Path, default=REPO / ".bench-reliability",
                       help="scratch directory (removed afterwards)")
        s.add_argument("--out", type=Path, default=RESULTS, help="directory of reliability_<suite>.json")
    args = p.parse_args(argv)
    console = make_console()
    with scratch_dir(args.dir, f"{args.suite}-") as work:
        machine = machine_info(None, path=work)
        result = {"crash": crash, "corrupt": corrupt}[args.suite](args, work, console)
    table = Table(title=f"reliability: {args.suite} (seed {args.seed})")
    console.print(f"machine: {machine_line(machine)}", markup=False, highlight=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in result.items():
        table.add_row(name, str(value))
    console.print(table)
    write_json(args.out / f"reliability_{args.suite}.json", {"machine": machine, "seed": args.seed, **result})
    return 0 if result["wrong_bytes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
