"""Long reliability suites for the page store (the fast versions run in the test suite).

    .venv/bin/python benchmarks/reliability.py crash --kills 1000     # SIGKILL a writer at random points
    .venv/bin/python benchmarks/reliability.py corrupt --faults 10000 # flip bits, zero blocks, truncate files

crash: a writer process (tests/store/crash_writer.py) puts seeded pages under ``batch`` or ``always``
durability, with small checkpoint intervals and a capacity that forces eviction, and is killed with SIGKILL
after a random number of acknowledged batches. Each reopen checks every served page byte for byte and
that the newest acknowledged pages (those eviction cannot have taken) survived.
corrupt: rounds of: populate a store, inject faults anywhere in its files, reopen, read every page.
Both print a table and write JSON to benchmarks/results/; "wrong bytes served" must be 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "store")]

from crash_writer import page_bytes_for  # noqa: E402
from support import HostMemory, key, open_store  # noqa: E402
from test_crash_recovery import CAPACITY, PAGE, run_and_kill  # noqa: E402

from sgl_kvtier.errors import KVTierError  # noqa: E402


def check_store(path: Path, must_have: list[int]) -> tuple[int, int, int]:
    """(pages checked, wrong bytes served, acknowledged pages lost)."""
    mem = HostMemory(1, page_bytes=PAGE)
    checked = wrong = 0
    with open_store(path, capacity_pages=CAPACITY, page_bytes=PAGE, eviction="lru") as store:
        for k in store.keys():
            if store.get([k], [mem.runs(0)]) == [True]:
                checked += 1
                wrong += mem.page(0).tobytes() != page_bytes_for(int.from_bytes(k[:4], "little"), PAGE)
        lost = sum(not store.contains(key(n)) for n in must_have)
    return checked, wrong, lost


def crash(args: argparse.Namespace, console: Console) -> dict:
    rng = random.Random(args.seed)
    root = Path(args.dir) / "crash-store"
    root.mkdir(parents=True, exist_ok=True)
    totals = {"kills": 0, "pages_checked": 0, "wrong_bytes": 0, "acked_pages_lost": 0, "acked_pages": 0}
    start = time.monotonic()
    with Progress(console=console) as progress:
        task = progress.add_task("SIGKILL rounds", total=args.kills)
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
            progress.advance(task)
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


def corrupt(args: argparse.Namespace, console: Console) -> dict:
    rng = np.random.default_rng(args.seed)
    totals = {"faults": 0, "rounds": 0, "pages_written": 0, "pages_served": 0, "wrong_bytes": 0,
              "refused_opens": 0, "bit_flip": 0, "zeroed_4k": 0, "truncated": 0}
    per_round, n_pages = 10, 32
    start = time.monotonic()
    with Progress(console=console) as progress:
        task = progress.add_task("injected faults", total=args.faults)
        while totals["faults"] < args.faults:
            path = Path(args.dir) / f"corrupt-{totals['rounds']}"
            path.mkdir(parents=True)
            mem = HostMemory(n_pages, page_bytes=PAGE)
            truth = {n: mem.fill(n, int(rng.integers(1 << 30))) for n in range(n_pages)}
            with open_store(path, capacity_pages=64, page_bytes=PAGE, checkpoint_interval=16) as store:
                for first in range(0, n_pages, 8):  # several batches: journal + checkpoints on disk
                    store.put([key(n) for n in range(first, first + 8)], [mem.runs(n) for n in range(first, first + 8)])
            files = [p for p in path.glob("ns-*/*") if p.name != "LOCK"]
            for kind, count in inject(files, rng, per_round).items():
                totals[kind] += count
            try:
                with open_store(path, capacity_pages=64, page_bytes=PAGE) as store:
                    mem.clear()
                    got = store.get([key(n) for n in range(n_pages)], [mem.runs(n) for n in range(n_pages)])
                    for n, ok in enumerate(got):
                        if ok:
                            totals["pages_served"] += 1
                            totals["wrong_bytes"] += mem.page(n).tobytes() != truth[n]
            except KVTierError:
                totals["refused_opens"] += 1  # a destroyed header is refused with a clear error
            totals["faults"] += per_round
            totals["rounds"] += 1
            totals["pages_written"] += n_pages
            progress.advance(task, per_round)
            for p in sorted(path.rglob("*"), reverse=True):
                p.unlink() if p.is_file() else p.rmdir()
            path.rmdir()
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
        s.add_argument("--dir", default=str(ROOT / ".bench-reliability"))
        s.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    console = Console()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    result = {"crash": crash, "corrupt": corrupt}[args.suite](args, console)
    table = Table(title=f"reliability: {args.suite} (seed {args.seed})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in result.items():
        table.add_row(name, str(value))
    console.print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"reliability_{args.suite}.json").write_text(json.dumps({"seed": args.seed, **result}, indent=2))
    return 0 if result["wrong_bytes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
