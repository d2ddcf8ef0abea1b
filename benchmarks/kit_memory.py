"""Peak RSS of SGLang's UnifiedRadixCache kit scenarios in one pytest process: KVTierStorage vs SGLang's ``file``.

Each run is one child process, ``python -m pytest tests/sglang/test_kit_l3.py -n 0 -p no:randomly
-p benchmarks.kit_memory`` with ``KVTIER_KIT_BACKEND`` set to ``kvtier`` or ``file``; its peak RSS is the
kernel's (``os.wait4``: ``ru_maxrss`` of that child alone). With ``file`` this module, loaded as a pytest
plugin, hands the kit's L3 caches SGLang's own ``HiCacheFile`` on the same storage directory instead of
ours (``_route_to_file``) and lets ``kit_l3``'s backend checks take any backend. The scenarios that look
into our store (its tiers, its counters) cannot pass there, so by default both backends run the
backend-neutral ones (``NEUTRAL``; ``-k ''`` runs every scenario, the failures counted in the table).

The peak is mostly SGLang's own: its caches sit in reference cycles (the kit's host pools with them), so
they go only when the cyclic collector runs, and the peak moves with its timing by up to ~1.5 GiB from run
to run. ``--late`` measures what a backend leaves to that collector instead: after every test the child
collects with ``gc.DEBUG_SAVEALL`` and counts what only the collector freed (``_note_late``): backends
(``KVTierStorage`` objects) and the bytes of the tensors' storages; those runs' peaks are then with a
collection after every test.

Run from the repository root: ``python -m benchmarks.kit_memory`` (``--help``); prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO

ENV = "KVTIER_KIT_BACKEND"
LATE_ENV = "KVTIER_KIT_LATE"  # a file: the child appends one JSON line per test of what the collector freed
KIT_TESTS = "tests/sglang/test_kit_l3.py"
NEUTRAL = "produced_by_one_cache or buffer_only or missed_l3_query"  # only the kit's own helpers look


# ---------------------------------------------------------------------------- the pytest plugin (in the child)
def pytest_configure(config: Any) -> None:
    if os.environ.get(ENV) == "file":
        _route_to_file()


def pytest_collection_finish(session: Any) -> None:
    kit_l3 = sys.modules.get("kit_l3")
    if os.environ.get(ENV) == "file" and kit_l3 is not None:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

        kit_l3.KVTierStorage = HiCacheStorage  # its checks: "the cache's backend is an L3 backend"


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    out = os.environ.get(LATE_ENV)
    if out:
        _note_late(Path(out))


def _note_late(out: Path) -> None:
    """What only the cyclic collector frees now (the test just ended): backends, and tensor storage bytes."""
    import torch

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found, storages = list(gc.garbage), {}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    for obj in found:
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # no storage (meta, sparse)
                pass
    backends = sum(type(obj).__name__ == "KVTierStorage" for obj in found)
    del found
    gc.collect()
    with out.open("a") as f:
        f.write(json.dumps({"backends": backends, "tensor_bytes": sum(storages.values())}) + "\n")


def _route_to_file() -> None:
    """SGLang's factory builds ``HiCacheFile`` on the first device wherever kit_l3 asks for our backend; the
    extra config keeps SGLang's own keys only (no ``interface_v1``: the controller's generic page calls)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    create = StorageBackendFactory.create_backend

    def create_backend(backend_name: str, storage_config: Any, mem_pool_host: Any, **kwargs: Any) -> Any:
        extra = storage_config.extra_config or {}
        if backend_name == "dynamic" and extra.get("backend_name") == "kvtier":
            kept = {k: v for k, v in extra.items() if k.startswith("prefetch")}
            storage_config.extra_config = {"file_storage_path": extra["devices"][0], **kept}
            backend_name = "file"
        return create(backend_name, storage_config, mem_pool_host, **kwargs)

    StorageBackendFactory.create_backend = staticmethod(create_backend)  # type: ignore[method-assign]


# ---------------------------------------------------------------------------- the runs (in the parent)
def run(backend: str, select: str, late: bool) -> dict[str, Any]:
    """One child pytest run of the kit scenarios on ``backend``: its peak RSS, outcome line, wall time and
    (``late``) what the cyclic collector freed after each test."""
    cmd = [sys.executable, "-m", "pytest", KIT_TESTS, "-n", "0", "-p", "no:randomly", "-p", "no:cacheprovider",
           "-q", "-p", "benchmarks.kit_memory", *(["-k", select] if select else [])]
    with tempfile.TemporaryDirectory() as scratch:
        notes = Path(scratch) / "late.jsonl"
        env = {**os.environ, ENV: backend, **({LATE_ENV: str(notes)} if late else {})}
        start = time.monotonic()
        child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert child.stdout is not None
        out = child.stdout.read()  # to its end: the child is done
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS (KiB on Linux)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
        tests = [json.loads(line) for line in notes.read_text().splitlines()] if notes.exists() else []
    outcome = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "?")
    return {"backend": backend, "peak_rss_gib": usage.ru_maxrss / 2**20, "outcome": outcome.strip("= "),
            "wall_s": wall, "late_backends": sum(t["backends"] for t in tests),
            "late_gib": sum(t["tensor_bytes"] for t in tests) / 2**30,
            "late_max_mib": max((t["tensor_bytes"] for t in tests), default=0) / 2**20}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", choices=("kvtier", "file"), action="append",
                        help="run only these (repeatable; default: both, each in a process of its own)")
    parser.add_argument("-k", dest="select", default=NEUTRAL, help="pytest -k expression ('' = every scenario)")
    parser.add_argument("--late", action="store_true", help="count what only the cyclic collector freed, per test")
    args = parser.parse_args(argv)
    from benchmarks.machine import machine_info, machine_line

    rows = [run(backend, args.select, args.late) for backend in args.backend or ["kvtier", "file"]]
    print(f"kit memory, {time.strftime('%Y-%m-%d %H:%M')}; {machine_line(machine_info(None, probe=False))}")
    print(f"command: {shlex.join(['python', '-m', 'benchmarks.kit_memory', *(argv or sys.argv[1:])])}\n")
    late = " | backends freed late | tensors freed late (GiB, all tests) | most in one test (MiB)" if args.late else ""
    print(f"| backend | peak RSS (GiB) | vs file | tests | wall (s){late} |")
    print("|---" * (5 + 3 * args.late) + "|")
    file_peak = next((r["peak_rss_gib"] for r in rows if r["backend"] == "file"), None)
    for r in rows:
        ratio = f"{r['peak_rss_gib'] / file_peak:.2f}x" if file_peak else "-"
        cells = f" | {r['late_backends']} | {r['late_gib']:.2f} | {r['late_max_mib']:.0f}" if args.late else ""
        print(f"| {r['backend']} | {r['peak_rss_gib']:.2f} | {ratio} | {r['outcome']} | {r['wall_s']:.0f}{cells} |")
    print(f"\neach row: `{KIT_TESTS}`, -k {args.select!r}, {ENV}=<backend>, one pytest process (-n 0)")


if __name__ == "__main__":
    main()
