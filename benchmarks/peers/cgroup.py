"""A memory cgroup (cgroup v1 ``memory`` controller) per system: its server and services run in it, under a limit
sized so the page cache cannot hold the L3 working set, and what it held is read per phase.

Sizing (``size_limit``): the cgroup starts unlimited; once the services and the server are up and idle, its
*resident* memory (anonymous + mapped files + shmem: what the processes need, not the reclaimable page cache of
the model files read at start-up) is measured, and the limit is set to that, plus the KV pools SGLang allocated
but has not touched yet (device + host pool: zero pages until written), plus the system's own DRAM store
(Mooncake's segment, LMCache's L1), plus a page-cache allowance (``--page-cache-mb``) that is a small fraction of
the L3 working set. A file-based L3 then re-reads its pages from the disk instead of the page cache; the run
records the cgroup's page cache, major faults and the bytes its processes read from the block layer per phase
(``snapshot``), which show whether the limit bit.

The cgroups nest under the benchmark's own memory cgroup (``own``), so a machine that confines the benchmark
confines them too. Processes join theirs through ``wrap`` (a shell writes its pid into ``cgroup.procs`` and
execs the command): everything they start inherits it, so the scheduler and detokenizer SGLang spawns are in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

MOUNT = Path("/sys/fs/cgroup/memory")
# memory.stat fields read per phase (the hierarchical "total_" ones: the cgroup and anything under it).
STAT_KEYS = ("total_cache", "total_rss", "total_shmem", "total_mapped_file", "total_pgmajfault", "total_pgpgin")
MiB = 1 << 20


def own(mount: Path = MOUNT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> Path | None:
    """This process's memory cgroup directory (cgroup v1), or None where the controller is not mounted."""
    if not (mount / "cgroup.procs").exists():
        return None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return mount / path.lstrip("/")
    return None


def unavailable(mount: Path = MOUNT) -> str | None:
    """Why no memory cgroup can be made here (None: it can)."""
    parent = own(mount)
    if parent is None:
        return f"no cgroup v1 memory controller at {mount}"
    if not os.access(parent, os.W_OK):
        return f"{parent} is not writable (run as root)"
    return None


@dataclasses.dataclass(frozen=True)
class Sizing:
    """A cgroup limit and the terms it is the sum of (bytes)."""

    resident_bytes: int  # measured: anon + mapped files + shmem of the services and the idle server
    pools_bytes: int  # SGLang's device + host KV pools (allocated, not yet written: not resident at start-up)
    dram_store_bytes: int  # the system's own DRAM store outside SGLang's pools (0 for most)
    page_cache_bytes: int  # the allowance for everything else, page cache included

    @property
    def limit_bytes(self) -> int:
        return self.resident_bytes + self.pools_bytes + self.dram_store_bytes + self.page_cache_bytes

    def record(self, working_set_bytes: int) -> dict[str, Any]:
        """The sizing as a result records it, with how many times the L3 working set exceeds the allowance."""
        return {**dataclasses.asdict(self), "limit_bytes": self.limit_bytes, "working_set_bytes": working_set_bytes,
                "working_set_over_allowance": round(working_set_bytes / max(1, self.page_cache_bytes), 2)}


def resident(stat: dict[str, int]) -> int:
    """What the processes need of a cgroup's memory: anonymous memory, mapped files and shmem (the rest of
    ``total_cache`` is page cache the kernel may reclaim)."""
    return stat.get("total_rss", 0) + stat.get("total_mapped_file", 0) + stat.get("total_shmem", 0)


def size_limit(stat: dict[str, int], pools_bytes: int, dram_store_bytes: int, page_cache_bytes: int) -> Sizing:
    """The limit of a cgroup whose idle server and services show ``stat`` (its ``memory.stat``)."""
    return Sizing(resident(stat), pools_bytes, dram_store_bytes, page_cache_bytes)


def allowance_warning(page_cache_bytes: int, working_set_bytes: int, factor: float = 4.0) -> str | None:
    """A sentence when the page-cache allowance is not clearly smaller than the L3 working set (the limit would
    not keep a file-based L3's pages out of DRAM), else None."""
    if working_set_bytes >= factor * page_cache_bytes:
        return None
    return (f"page-cache allowance {page_cache_bytes / MiB:.0f} MiB is more than 1/{factor:g} of the L3 working set "
            f"{working_set_bytes / MiB:.0f} MiB: a file-based L3 may be served from the page cache")


class MemoryCgroup:
    """One cgroup directory: made by ``create``, removed (its processes killed first) by ``remove``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, parent: Path, name: str) -> MemoryCgroup:
        path = Path(parent) / name
        path.mkdir(parents=False, exist_ok=True)
        return cls(path)

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def wrap(self, command: list[str]) -> list[str]:
        """``command`` run inside this cgroup (and everything it starts)."""
        return ["/bin/sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh", str(self.path / "cgroup.procs"),
                *command]

    def stat(self) -> dict[str, int]:
        out = {}
        for line in self._read("memory.stat").splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(value)
        return out

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self._read("cgroup.procs").split()]
        except OSError:
            return []

    def set_limit(self, nbytes: int) -> None:
        """Set ``memory.limit_in_bytes``; the kernel reclaims page cache down to it first (EBUSY if it cannot)."""
        (self.path / "memory.limit_in_bytes").write_text(f"{nbytes}\n")

    def limit(self) -> int:
        return int(self._read("memory.limit_in_bytes"))

    def reset_peak(self) -> None:
        with contextlib.suppress(OSError):
            (self.path / "memory.max_usage_in_bytes").write_text("0\n")

    def oom_kills(self) -> int:
        for line in self._read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def read_bytes(self) -> int:
        """Bytes the cgroup's live processes read from the block layer (``/proc/<pid>/io`` read_bytes): page-cache
        hits and O_DIRECT aside, what came off the disk."""
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                    if line.startswith("read_bytes:"):
                        total += int(line.split()[1])
        return total

    def snapshot(self) -> dict[str, float]:
        """The readings kept before and after each phase: memory.stat's page cache, resident memory, major faults
        and pages paged in; usage, its peak (since ``reset_peak``), the limit's failures, OOM kills; bytes read."""
        stat = self.stat()
        out: dict[str, float] = {k: float(stat.get(k, 0)) for k in STAT_KEYS}
        out["usage_bytes"] = float(self._read("memory.usage_in_bytes"))
        out["peak_bytes"] = float(self._read("memory.max_usage_in_bytes"))
        out["failcnt"] = float(self._read("memory.failcnt"))
        out["oom_kills"] = float(self.oom_kills())
        out["read_bytes"] = float(self.read_bytes())
        return out

    def kill(self, grace_s: float = 10.0) -> list[int]:
        """SIGTERM, then SIGKILL, every process still in the cgroup (all started by this benchmark); their pids."""
        left = self.pids()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace_s
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.pids():
                break
        return left

    def remove(self) -> None:
        """Kill what is left in it and remove the directory (a cgroup is removed with rmdir)."""
        if not self.path.exists():
            return
        self.kill()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.2)  # a killed process leaves the cgroup a moment after it dies
