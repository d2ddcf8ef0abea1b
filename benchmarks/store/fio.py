"""fio on the directory under test, with the store's block size and queue depth: the baseline of the
store-level benchmarks."""

from __future__ import annotations

import json
import subprocess
from typing import TYPE_CHECKING

from sgl_kvtier.config import MiB

if TYPE_CHECKING:
    from benchmarks.store.context import Ctx


def fio_version() -> str:
    try:
        proc = subprocess.run(["fio", "--version"], capture_output=True, text=True)
    except FileNotFoundError:
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def run_fio(ctx: Ctx, page_bytes: int, rw: str, nbytes: int, jobs: int = 1) -> tuple[float, str]:
    """fio bandwidth (GB/s) with the store's block size and queue depth; io_uring, else libaio, else psync.
    ``jobs`` > 1: that many jobs (processes), a file of ``nbytes`` each in the scratch directory, bandwidth
    summed over them."""
    path, errors = ctx.fio_target(), []
    where = [f"--filename={path}"] if jobs == 1 else [f"--directory={ctx.root}", f"--numjobs={jobs}",
                                                      "--group_reporting"]
    for engine in ("io_uring", "libaio", "psync"):
        cmd = ["fio", "--name=bench", *where, f"--rw={rw}", f"--bs={page_bytes}",
               f"--iodepth={ctx.args.io_depth}", f"--ioengine={engine}", "--direct=1", f"--size={nbytes}",
               "--output-format=json"] + (["--end_fsync=1"] if rw == "write" else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        try:
            job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
            if proc.returncode == 0 and job["error"] == 0 and job[rw]["bw_bytes"] > 0:
                return job[rw]["bw_bytes"] / 1e9, engine
        except (ValueError, KeyError, IndexError):
            pass
        errors.append(f"{engine}: rc={proc.returncode} {proc.stderr.strip()[-200:]}")
    raise RuntimeError("fio failed with every engine: " + "; ".join(errors))


def measure_fio(ctx: Ctx, page_bytes: int) -> None:
    """This round's fio write (end_fsync) then read (after dropping caches), same bytes as a store pass."""
    nbytes = ctx.pass_bytes(page_bytes)
    task = ctx.task(f"fio {page_bytes / MiB:g} MiB write+read", 2)
    (ctx.root / "fio.dat").unlink(missing_ok=True)  # a raw device is written over in place
    write, engine = run_fio(ctx, page_bytes, "write", nbytes)
    ctx.step(task)
    ctx.drop_caches()
    read, _ = run_fio(ctx, page_bytes, "read", nbytes)
    ctx.step(task)
    (ctx.root / "fio.dat").unlink(missing_ok=True)
    ctx.fio[page_bytes] = {"write": write, "read": read, "engine": engine, "bytes": nbytes}
    ctx.fio_log.append({"page_mib": page_bytes / MiB, **ctx.fio[page_bytes]})
