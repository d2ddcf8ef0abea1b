"""What a serving run reads off the machine besides HTTP: the server's process tree (CPU seconds, memory,
open files), the scheduler process (for py-spy), L3 store sizes, and SGLang's JIT hash extension."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.serving import configs


def process_tree(pid: int) -> Iterator[Any]:
    """``psutil.Process`` of ``pid`` and of all its descendants (none if it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        yield from [root, *root.children(recursive=True)]
    except psutil.Error:
        return


def prebuild_hash_extension() -> dict[str, Any]:
    """Build/load SGLang's HiCache hash extension (torch JIT) here, before any server needs it.

    Each server's storage threads load it on first use, under a lock shared by every process on the
    machine; a stale lock or an out-of-date build then costs a compile inside the prefetch thread, and a
    `/flush_cache` meanwhile kills the scheduler (SGLang joins its storage threads with a 10 s timeout).
    """
    t0 = time.monotonic()
    try:
        from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

        _load_native_hash_module()
        return {"ok": True, "seconds": round(time.monotonic() - t0, 2)}
    except Exception as exc:  # noqa: BLE001 - the servers will report the real problem, if any
        return {"ok": False, "error": repr(exc)[:500]}


def scheduler_pid(server_pid: int) -> int | None:
    import psutil

    for child in list(process_tree(server_pid))[1:]:
        try:
            if "scheduler" in " ".join(child.cmdline() or [child.name()]):
                return child.pid
        except psutil.Error:
            continue
    return None


def cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the server's processes, and by the whole machine.

    Wall-clock TTFT on a shared machine mixes our cost with other people's load; the server's own CPU
    seconds per phase do not. `machine_busy_s` - `server_s` is what everything else took meanwhile.
    """
    import psutil

    total = 0.0
    for proc in process_tree(server_pid):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    m = psutil.cpu_times()
    return {"server_s": total, "machine_busy_s": m.user + m.nice + m.system + m.irq + m.softirq + getattr(m, "steal", 0.0)}


def thread_group(process: str, thread: str) -> str:
    """The group a thread's CPU counts under: sgl-kvtier's threads by their pool (``kvtier-io_3`` ->
    ``kvtier-io``; ``sgl_kvtier.io.threads`` names them), every other thread under its process's name
    (``sglang::scheduler``: the forward, its OpenMP team and SGLang's own threads)."""
    if thread.startswith("kvtier-"):
        return re.sub(r"_\d+$", "", thread)
    return process


def thread_cpu(server_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the server's threads, summed by ``thread_group``. Threads
    that ended (the layer loader's, one per load) count under ``<process> (ended threads)``: the process's
    total less its live threads'."""
    import psutil

    out: dict[str, float] = {}
    for proc in process_tree(server_pid):
        try:
            name, threads, times = proc.name(), proc.threads(), proc.cpu_times()
        except psutil.Error:
            continue
        ended = f"{name} (ended threads)"
        out[ended] = out.get(ended, 0.0) + times.user + times.system - sum(t.user_time + t.system_time
                                                                          for t in threads)
        for t in threads:
            try:
                comm = Path(f"/proc/{proc.pid}/task/{t.id}/comm").read_text().strip()
            except OSError:
                continue
            key = thread_group(name, comm)
            out[key] = out.get(key, 0.0) + t.user_time + t.system_time
    return out


def tree_usage(server_pid: int) -> tuple[float, int]:
    """(RSS MiB, open file descriptors) of the server's processes together."""
    import psutil

    rss, fds = 0, 0
    for proc in process_tree(server_pid):
        try:
            rss += proc.memory_info().rss
            fds += proc.num_fds()
        except psutil.Error:
            continue
    return rss / 2**20, fds


def store_summary(cfg: configs.Config, path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    files = [f for f in path.rglob("*") if f.is_file()]
    out: dict[str, Any] = {"path": str(path), "files": len(files), "bytes_on_disk": sum(f.stat().st_size for f in files)}
    if cfg.l3 == "kvtier":
        from sgl_kvtier.admin.fsck import find_shards, shard_summary

        out["shards"] = [shard_summary(s) for s in find_shards(str(path))]
    return out
