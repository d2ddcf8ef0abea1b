"""A memory cgroup (cgroup v1 ``memory`` controller) per system: its server and services run in it, under a limit
that keeps the page cache far smaller than the L3 working set, and what it held is read per phase.

How the limit is chosen (``Cap``): a cgroup v1 limit bounds resident memory and page cache together, and what the
processes need of the first (KV pools written as they fill, a DRAM store, RocksDB's memtables, an allocator's
arenas, a prefill's activations) grows while they serve. A fixed limit either leaves the page cache room to hold
the L3 or starves the processes into thrashing. So the limit follows the resident memory: every ``interval_s``
it is set to the cgroup's resident memory (``memory.stat`` ``total_rss + total_mapped_file + total_shmem``) plus
the page-cache allowance (``--page-cache-mb``) plus a margin for what the processes may allocate before the next
update (``--margin-mb``), from the moment the server is up (before, the cgroup is unlimited: SGLang sizes its host
pool against the cgroup's free room and refuses to start under a tight limit). The page
cache no process maps (an L3's file pages) can then never hold more than allowance + margin, which is checked to be
a small fraction of the L3 working set (``allowance_warning``). The cgroup's OOM killer is off
(``memory.oom_control``): a burst larger than the margin stalls its process until the next update raises the limit,
instead of killing it.
A file-based L3 re-reads its pages from the disk instead of DRAM; the run records the cgroup's page cache, major
faults and the bytes its processes read from the block layer per phase (``snapshot``), which show whether the
limit bit, and the limit's range over the run (``Cap.record``).

The cgroups nest under the benchmark's own memory cgroup (``own``), so a machine that confines the benchmark
confines them too. Processes join theirs through ``wrap`` (a shell writes its pid into ``cgroup.procs`` and
execs the command): everything they start inherits it, so the scheduler and detokenizer SGLang spawns are in.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

MOUNT = Path("/sys/fs/cgroup/memory")
# memory.stat fields read per phase (the hierarchical "total_" ones: the cgroup and anything under it).
STAT_KEYS = ("total_cache", "total_rss", "total_shmem", "total_mapped_file", "total_pgmajfault", "total_pgpgin")
MiB = 1 << 20
UNLIMITED = -1  # what memory.limit_in_bytes takes for no limit


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


def resident(stat: dict[str, int]) -> int:
    """What the processes hold of a cgroup's memory: anonymous memory, mapped files and shmem (the rest of
    ``total_cache`` is page cache the kernel may reclaim)."""
    return stat.get("total_rss", 0) + stat.get("total_mapped_file", 0) + stat.get("total_shmem", 0)


def limit_for(stat: dict[str, int], allowance_bytes: int, margin_bytes: int) -> int:
    """The limit of a cgroup that shows ``stat`` now: its resident memory, the page-cache allowance and the margin."""
    return resident(stat) + allowance_bytes + margin_bytes


def allowance_warning(page_cache_bytes: int, working_set_bytes: int, factor: float = 4.0) -> str | None:
    """A sentence when the room left to the page cache (allowance + margin) is not clearly smaller than the L3
    working set (the limit would not keep a file-based L3's pages out of DRAM), else None."""
    if working_set_bytes >= factor * page_cache_bytes:
        return None
    return (f"page-cache room {page_cache_bytes / MiB:.0f} MiB (allowance + margin) is more than 1/{factor:g} of the "
            f"L3 working set {working_set_bytes / MiB:.0f} MiB: a file-based L3 may be served from the page cache")


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

    def _fields(self, name: str) -> dict[str, int]:
        """A file of ``key value`` lines (``memory.stat``, ``memory.oom_control``) as a dict."""
        out = {}
        for line in self._read(name).splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(value)
        return out

    def stat(self) -> dict[str, int]:
        return self._fields("memory.stat")

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self._read("cgroup.procs").split()]
        except OSError:
            return []

    def disable_oom_kill(self) -> None:
        """A process that hits the limit waits (until the limit is raised) instead of being killed."""
        (self.path / "memory.oom_control").write_text("1\n")

    def set_limit(self, nbytes: int) -> None:
        """Set ``memory.limit_in_bytes`` (``UNLIMITED``: none); the kernel reclaims page cache down to it first
        (EBUSY if it cannot)."""
        (self.path / "memory.limit_in_bytes").write_text(f"{nbytes}\n")

    def limit(self) -> int:
        return int(self._read("memory.limit_in_bytes"))

    def reset_peak(self) -> None:
        with contextlib.suppress(OSError):
            (self.path / "memory.max_usage_in_bytes").write_text("0\n")

    def oom_control(self) -> dict[str, int]:
        return self._fields("memory.oom_control")

    def oom_kills(self) -> int:
        return self.oom_control().get("oom_kill", 0)

    def read_bytes(self) -> int:
        """Bytes the cgroup's live processes read from the block layer (``/proc/<pid>/io`` read_bytes): what came
        off the disk, O_DIRECT reads included; page-cache hits are not."""
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


class Cap:
    """Keeps ``cg``'s limit at ``limit_for`` its current ``memory.stat`` (a thread, every ``interval_s``, from
    ``start`` to ``stop``); ``record`` says how it was set and what it went through."""

    def __init__(self, cg: MemoryCgroup, allowance_bytes: int, margin_bytes: int, interval_s: float = 0.1) -> None:
        self.cg, self.allowance, self.margin, self.interval_s = cg, allowance_bytes, margin_bytes, interval_s
        self.updates = self.errors = 0
        self.low = self.high = 0
        self.last_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self) -> int:
        """Set the limit once; the limit set (the old one when the kernel refused)."""
        target = limit_for(self.cg.stat(), self.allowance, self.margin)
        try:
            self.cg.set_limit(target)
        except OSError as exc:  # EBUSY: the kernel could not reclaim down to it yet; the next update retries
            self.errors += 1
            self.last_error = repr(exc)
            return self.cg.limit()
        self.updates += 1
        self.low = target if not self.low else min(self.low, target)
        self.high = max(self.high, target)
        return target

    def start(self) -> Cap:
        with contextlib.suppress(OSError):
            self.cg.disable_oom_kill()
        self.update()
        self._thread = threading.Thread(target=self._run, name="cgroup-cap", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError):
                self.update()

    def stop(self) -> None:
        """Stop following and lift the limit: with the OOM killer off, a process that allocates past a limit
        nobody raises any more would wait for ever, its teardown too."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with contextlib.suppress(OSError):
            self.cg.set_limit(UNLIMITED)

    def record(self) -> dict[str, Any]:
        return {"rule": "limit = resident (total_rss + total_mapped_file + total_shmem) + allowance + margin, "
                        f"updated every {self.interval_s:g} s",
                "allowance_bytes": self.allowance, "margin_bytes": self.margin, "interval_s": self.interval_s,
                "updates": self.updates, "refused": self.errors, "last_refusal": self.last_error,
                "limit_low_bytes": self.low, "limit_high_bytes": self.high, "oom_control": self.cg.oom_control()}
