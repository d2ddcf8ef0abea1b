"""The machine side of bench_serving: page cache, CPU accounting, L3 store sizes, SGLang's JIT hash
extension, and the scheduler process (for py-spy)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from serving import configs

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def page_cache_policy(disabled: bool) -> tuple[bool, str]:
    """(drop the page cache between phases?, the sentence that says so in the report)."""
    if disabled:
        return False, "NOT dropped (--no-drop-caches): L3 reads of the file backend may come from the page cache"
    if os.geteuid() != 0 or not os.access(DROP_CACHES, os.W_OK):
        return False, "NOT dropped (not root): L3 reads of the file backend may come from the page cache"
    return True, "dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before every phase; kvtier also reads with O_DIRECT"


def drop_caches() -> float:
    t0 = time.monotonic()
    os.sync()
    DROP_CACHES.write_text("3\n")
    return time.monotonic() - t0


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

    try:
        for child in psutil.Process(server_pid).children(recursive=True):
            if "scheduler" in " ".join(child.cmdline() or [child.name()]):
                return child.pid
    except psutil.Error:
        return None
    return None


def cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the server's processes, and by the whole machine.

    Wall-clock TTFT on a shared machine mixes our cost with other people's load; the server's own CPU
    seconds per phase do not. `machine_busy_s` - `server_s` is what everything else took meanwhile.
    """
    import psutil

    total = 0.0
    try:
        root = psutil.Process(server_pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    m = psutil.cpu_times()
    return {"server_s": total, "machine_busy_s": m.user + m.nice + m.system + m.irq + m.softirq + getattr(m, "steal", 0.0)}


def store_summary(cfg: configs.Config, path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    files = [f for f in path.rglob("*") if f.is_file()]
    out: dict[str, Any] = {"path": str(path), "files": len(files), "bytes_on_disk": sum(f.stat().st_size for f in files)}
    if cfg.l3 == "kvtier":
        from sgl_kvtier.store.fsck import find_shards, shard_summary

        out["shards"] = [shard_summary(s) for s in find_shards(str(path))]
    return out
