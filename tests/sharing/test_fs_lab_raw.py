"""A shared raw pool on a real block device seen by two lab hosts: a loop device (direct IO) over a file,
formatted for two host slots, and a writer on each lab host (``host_index`` 0 and 1, the
host's own hostname as ``host_id``, its own boot id). Each writer is a ``sharing_worker.py`` process run on its
host; every page read is checked byte for byte; every descriptor a writer holds on the device is O_DIRECT.
Waits poll a condition against a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_fs_lab import SERVE_S, HostProc, served
from test_sharing import PAGE

from benchmarks.cluster.lab import Lab, LabError, run
from sgl_kvtier.media.shared_raw.superblock import format_pool

pytestmark = pytest.mark.slow

POOL_BYTES = 64 << 20


def raw(host_index: int, host_id: str) -> dict[str, Any]:
    return {"sharing": "cluster", "host_index": host_index, "host_id": host_id, "heartbeat_s": 0.25,
            "dead_after_s": 1.5, "reclaim_after_s": 600.0, "checkpoint_interval": 64}


@pytest.fixture
def loop_pool(fs_lab: Lab, tmp_path: Path) -> Iterator[str]:
    """A loop device (direct IO on) over a fresh file, pool-formatted for two hosts from lab host 0."""
    backing = tmp_path / "namespace.img"
    with open(backing, "wb") as f:
        f.truncate(POOL_BYTES)
    try:
        dev = run(["losetup", "--find", "--show", "--direct-io=on", str(backing)]).stdout.strip()
    except LabError as exc:
        pytest.skip(f"no loop device can be made here: {exc}")
    try:
        format_pool([dev], 2)  # the device node is the same one on every host
        yield dev
    finally:
        run(["losetup", "--detach", dev], check=False)


def direct_descriptors(pid: int, dev: str) -> list[bool]:
    """For each descriptor ``pid`` holds on ``dev``: whether it is O_DIRECT (its ``fdinfo`` flags)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != dev:
                continue
            flags = next(line for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
                         if line.startswith("flags:"))
        except (OSError, StopIteration):
            continue  # closed meanwhile
        out.append(bool(int(flags.split()[1], 8) & os.O_DIRECT))
    return out


def test_two_hosts_share_a_raw_pool_on_one_block_device(fs_lab: Lab, loop_pool: str) -> None:
    made: list[HostProc] = []

    def writer(i: int) -> HostProc:
        made.append(HostProc(fs_lab.hosts[i]))
        host = fs_lab.hosts[i]
        wid = made[-1].call("open", role="writer", path=loop_pool, page_bytes=PAGE, capacity_pages=48,
                            config=raw(i, host.hostname))["wid"]
        assert wid == f"{host.hostname}-0"
        return made[-1]

    try:
        a, b = writer(0), writer(1)
        for proc in (a, b):
            held = direct_descriptors(proc.p.pid, loop_pool)
            assert held and all(held), held  # the device, never through the page cache
        assert a.call("put", keys=list(range(40)))["ok"] == [True] * 40
        assert b.call("put", keys=list(range(100, 140)))["ok"] == [True] * 40
        assert served(b, list(range(40)), 40) == list(range(40))  # A's share, read on B
        assert served(a, list(range(100, 140)), 40) == list(range(100, 140))
        a.p.send_signal(signal.SIGKILL)
        a.p.wait(timeout=SERVE_S)
        # B judges A dead by its lease standing still, never retires another host, still serves its pages.
        wid_a = f"{fs_lab.hosts[0].hostname}-0"
        deadline = time.monotonic() + SERVE_S
        while (verdicts := b.call("verdicts")).get(wid_a) != "dead":
            assert time.monotonic() < deadline, f"B never judged A dead: {verdicts}"
            b.call("refresh")
            time.sleep(0.1)  # the poll's pace: A's lease stands still on B's clock
        seen = b.call("get", keys=list(range(40)))
        assert seen["hits"] == list(range(40)) and seen["wrong"] == []  # a dead host's pages stay readable
        assert b.call("stats")["sharing"]["writers_retired"] == 0  # never retired by another host
        again = writer(0)  # host 0 starts again: its writer adopts its region, warm
        seen = again.call("get", keys=list(range(40)))
        assert seen["hits"] == list(range(40)) and seen["wrong"] == []
        assert again.call("put", keys=list(range(200, 210)))["ok"] == [True] * 10
        assert served(b, list(range(200, 210)), 10) == list(range(200, 210))
    finally:
        for proc in made:
            if proc.p.poll() is None:
                proc.kill()
        for proc in made:
            try:
                proc.p.wait(timeout=SERVE_S)
            except subprocess.TimeoutExpired:
                pass
