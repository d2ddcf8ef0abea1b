"""What every benchmark script shares: paths, the page cache, scratch directories, progress bars, results.

Machine facts are in ``benchmarks.machine``; store-level helpers in ``benchmarks.store``, real-server ones
in ``benchmarks.serving``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"  # git-ignored: raw runs go here
# The Mooncake FAST'25 conversation trace (github.com/kvcache-ai/Mooncake, FAST25-release/traces/
# conversation_trace.jsonl: one hour of a chat service, prefix-block hash ids only, no text), kept out of the
# repository in a data directory beside the checkout; every benchmark that replays it takes --trace.
TRACE = REPO.parent / "shared" / "data" / "mooncake_conversation_trace.jsonl"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def make_console(stderr: bool = False) -> Console:
    """A console that does not wrap logs at 80 columns when the output is a file or a pipe."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 180, log_path=False)


def median(values: list[float | None]) -> float | None:
    """Median of the values that are not None; None if there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def timestamp() -> str:
    """A run's start time as it names result directories: ``20260101-120000``."""
    return time.strftime("%Y%m%d-%H%M%S")


def store_room(nbytes: int) -> int:
    """A benchmark store's ``capacity_bytes`` for a working set of ``nbytes``: twice it, plus 64 MiB.

    Not ``nbytes + 1 GiB``: a capacity over one default segment (1 GiB) asks the filesystem for the whole segment
    before the first write, which a small run on a small CI disk need not have."""
    return 2 * nbytes + 64 * (1 << 20)


def files_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (a model directory's weights, mostly); 0 where there is none."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def can_drop_caches() -> bool:
    """Whether this process may drop the OS page cache (root, and the sysctl is writable)."""
    return os.geteuid() == 0 and os.access(DROP_CACHES, os.W_OK)


def drop_caches() -> float:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; the seconds it took. Raises OSError when not allowed."""
    t0 = time.monotonic()
    os.sync()
    DROP_CACHES.write_text("3\n")
    return time.monotonic() - t0


def page_cache_policy(disabled: bool) -> tuple[bool, str]:
    """(drop the page cache between phases?, the sentence that says so in the report)."""
    if disabled:
        return False, "NOT dropped (--no-drop-caches): L3 reads of the file backend may come from the page cache"
    if not can_drop_caches():
        return False, "NOT dropped (not root): L3 reads of the file backend may come from the page cache"
    return True, "dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before every phase; kvtier also reads with O_DIRECT"


def progress(console: Console, disable: bool = False, spinner: bool = False, transient: bool = False) -> Progress:
    """The progress display every script uses: description, bar, done/total, elapsed."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*((SpinnerColumn(),) if spinner else ()), *columns, console=console, disable=disable,
                    transient=transient, refresh_per_second=4)


@contextlib.contextmanager
def scratch_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A fresh directory under ``parent`` for one run, removed afterwards (``parent`` too if this made it)."""
    parent = Path(parent)
    made_parent = not parent.exists()
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if made_parent:
            shutil.rmtree(parent, ignore_errors=True)


def args_json(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A script's parsed arguments as JSON-able values (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in skip}


def write_json(path: Path, result: dict[str, Any]) -> Path:
    """Write one result file (its directory is made if missing); values JSON cannot hold become strings."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path
