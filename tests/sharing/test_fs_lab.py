"""``sharing = "cluster"`` across real hosts: writers on two lab hosts (``fs_lab``: network, mount and UTS
namespaces of their own, each with its own hostname, boot id and machine id) share one pool on a JuiceFS
mount. Each writer is a ``sharing_worker.py`` process run on its host; every page read is checked byte for
byte. Waits poll a condition against a deadline (the writers beat and follow on their own clocks).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fs_lab import Host, Lab
from test_sharing import PAGE, ROOT, WORKER, Proc

pytestmark = pytest.mark.slow

LIVE = {"sharing": "cluster", "heartbeat_s": 0.5, "dead_after_s": 600.0, "reclaim_after_s": 600.0}
SERVE_S = 30.0  # longest a page put on one host may take to be served on the other


class HostProc(Proc):
    """A ``sharing_worker.py`` process on a lab host: that host's hostname, boot id, machine id and mount."""

    def __init__(self, host: Host) -> None:
        env = {k: v for k, v in os.environ.items() if k != "KVTIER_BOOT_ID"}  # the host's own boot id counts
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{ROOT / 'tests'}"
        self.host = host
        self.p = host.popen(sys.executable, str(WORKER), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)


@pytest.fixture
def on_host(fs_lab: Lab) -> Iterator[Callable[[int], HostProc]]:
    """Start a worker on lab host ``i``; every one started is killed at the end of the test."""
    made: list[HostProc] = []

    def start(i: int) -> HostProc:
        made.append(HostProc(fs_lab.hosts[i]))
        return made[-1]

    yield start
    for proc in made:
        if proc.p.poll() is None:
            proc.kill()


def pool_dir(lab: Lab, name: str) -> str:
    """A fresh directory for one test's pool on the shared mount (made from host 0)."""
    path = lab.mount / name
    lab.hosts[0].run("mkdir", "-p", str(path))
    return str(path)


def open_writer(proc: HostProc, path: str, capacity_pages: int, config: dict[str, Any]) -> str:
    wid = proc.call("open", role="writer", path=path, page_bytes=PAGE, capacity_pages=capacity_pages,
                    config=config)["wid"]
    assert isinstance(wid, str)
    return wid


def served(proc: HostProc, keys: list[int], want: int, timeout_s: float = SERVE_S) -> list[int]:
    """Poll ``proc`` (refresh, then read ``keys``) until it serves at least ``want`` of them or the time is up;
    the keys served last. A page read with other bytes than were put fails the test at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        proc.call("refresh")
        seen = proc.call("get", keys=keys)
        assert seen["wrong"] == [], f"wrong bytes served for {seen['wrong']}"
        if len(seen["hits"]) >= want or time.monotonic() >= deadline:
            return list(seen["hits"])
        time.sleep(0.1)  # the poll's pace: the writer beats on its own clock


def wait_stats(proc: HostProc, done: Callable[[dict[str, Any]], bool], what: str, timeout_s: float = SERVE_S,
               step: Callable[[], object] | None = None) -> dict[str, Any]:
    """Poll ``proc``'s stats (running ``step`` before each look) until ``done(stats)``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if step is not None:
            step()
        stats = proc.call("stats")
        if done(stats):
            return stats
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s (last stats {stats})"
        time.sleep(0.1)


def check_shared_everywhere(lab: Lab) -> list[dict[str, Any]]:
    """``sgl-kvtier check-shared --peer-wait --json`` on both hosts of ``lab`` at once, on a fresh directory:
    the reports, in the hosts' order. Each must be fit and name the other host; the directory must be left
    empty."""
    path = pool_dir(lab, "check")
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_BOOT_ID"}
    env["PYTHONPATH"] = str(ROOT)
    runs = [host.popen(sys.executable, "-m", "sgl_kvtier", "check-shared", path, "--peer-wait", "40", "--json",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
            for host in lab.hosts]
    try:
        outs = [run.communicate(timeout=90) for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    reports = [json.loads(out) for out, _ in outs]
    for report, host, other in zip(reports, lab.hosts, reversed(lab.hosts)):
        print(f"check-shared on {host.hostname} ({lab.fs}): {report['cross']}; notes {report['notes']}")
        assert report["fit"], report["problems"]
        assert report["peer"]["host"] == other.hostname
    assert lab.hosts[0].run("ls", "-A", path).stdout == ""  # every probe file removed
    return reports


def test_the_lab_hosts_are_distinct_machines_on_one_filesystem(fs_lab):
    a, b = fs_lab.hosts
    assert len({a.hostname, b.hostname}) == len({a.boot_id, b.boot_id}) == len({a.machine_id, b.machine_id}) == 2
    assert a.run("hostname").stdout.strip() == a.hostname
    assert b.run("cat", "/proc/sys/kernel/random/boot_id").stdout.strip() == b.boot_id
    assert " - fuse.juicefs " in next(line for line in b.mountinfo().splitlines() if f" {fs_lab.mount} " in line)
    path = fs_lab.mount / "hello"
    a.run("sh", "-c", f"echo from-{a.hostname} > {path}")
    assert b.run("cat", str(path)).stdout.strip() == f"from-{a.hostname}"


def test_pages_a_writer_put_on_one_host_are_served_byte_exact_by_a_writer_on_another(fs_lab, on_host):
    path = pool_dir(fs_lab, "served")
    a, b = on_host(0), on_host(1)
    wid_a, wid_b = open_writer(a, path, 256, LIVE), open_writer(b, path, 256, LIVE)
    assert wid_a.startswith("labhost0-") and wid_b.startswith("labhost1-")  # each host's own hostname
    keys = list(range(120))
    assert a.call("put", keys=keys)["ok"] == [True] * len(keys)
    assert served(b, keys, len(keys)) == keys
    stats = b.call("stats")
    assert stats["own"] == 0 and stats["peers"] == [wid_a]  # every page came from A's segments


def test_a_writer_open_all_along_serves_what_the_other_host_churned_through_its_slots(fs_lab, on_host):
    """A puts far more pages than its pool holds (slots evicted and rewritten in place) while B, open from the
    start, reads them as they come; B then serves at least 99 % of what A holds, never a wrong byte."""
    path = pool_dir(fs_lab, "churn")
    a, b = on_host(0), on_host(1)
    open_writer(a, path, 64, LIVE)
    open_writer(b, path, 64, LIVE)
    keys = list(range(400))
    for start in range(0, len(keys), 20):
        a.call("put", keys=keys[start:start + 20])
        b.call("refresh")  # B's descriptors are open (and go stale) from its first read on
        assert b.call("get", keys=keys[max(0, start - 20):start + 20])["wrong"] == []
    deadline = time.monotonic() + SERVE_S
    while True:  # A's quota may still evict: count against the pages A holds both before and after B's read
        before = set(a.call("stats")["own_keys"])
        b.call("refresh")
        seen = b.call("get", keys=sorted(before))
        held = before & set(a.call("stats")["own_keys"])
        assert seen["wrong"] == [] and len(held) >= 32
        got = held & set(seen["hits"])
        if len(got) >= 0.99 * len(held) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)  # the poll's pace: the writer beats on its own clock
    counters = b.call("stats")["counters"]
    print(f"churn: A holds {len(held)}, B serves {len(got)}; B's counters {counters}")
    assert len(got) >= 0.99 * len(held), f"B served {len(got)} of the {len(held)} pages A holds ({counters})"


def test_a_writer_stopped_past_dead_after_is_retired_by_the_other_host_and_re_registers(fs_lab, on_host):
    fast = {"sharing": "cluster", "heartbeat_s": 0.25, "dead_after_s": 1.0, "reclaim_after_s": 1.0}
    path = pool_dir(fs_lab, "retire")
    a, b = on_host(0), on_host(1)
    old = open_writer(a, path, 64, fast)
    open_writer(b, path, 64, fast)
    assert a.call("put", keys=list(range(10)))["ok"] == [True] * 10
    assert served(b, list(range(10)), 10) == list(range(10))
    os.kill(a.p.pid, signal.SIGSTOP)  # the process is frozen: no beat, no IO, its LOCK still held
    try:
        stats = wait_stats(b, lambda s: s["sharing"]["writers_retired"] >= 1 and old not in s["peers"],
                           "B retiring the stopped writer", step=lambda: b.call("refresh"))
        assert b.call("get", keys=list(range(10)))["hits"] == []  # its files are deleted: misses, never errors
        left = fs_lab.hosts[1].run("find", path, "-maxdepth", "2", "-name", f"w-{old}").stdout
        assert left == "" and stats["sharing"]["peers_dropped"] >= 1  # its directory is gone for every host
    finally:
        os.kill(a.p.pid, signal.SIGCONT)
    # A's next beat finds its fence (its files deleted); its next put re-registers: a writer directory made
    # afresh (the lowest free one: the same name, as the old one is gone), a new incarnation.
    stats = wait_stats(a, lambda s: s["sharing"]["reregistrations"] >= 1, "A re-registering",
                       step=lambda: a.call("put", keys=[1000]))
    assert stats["wid"].startswith("labhost0-") and b.call("stats")["sharing"]["writers_retired"] == 1
    assert a.call("put", keys=list(range(100, 110)))["ok"] == [True] * 10
    assert served(b, list(range(100, 110)), 10) == list(range(100, 110))
    assert b.call("stats")["peers"] == [a.call("stats")["wid"]]
    assert b.call("get", keys=list(range(10)))["hits"] == []  # what A held before it was retired stays gone


def test_check_shared_on_two_hosts_reports_what_each_sees_of_the_others_files(fs_lab):
    """``sgl-kvtier check-shared --peer-wait`` on both hosts at once, on JuiceFS: fit (the store adapts), each
    names the other, and reports cluster-wide locks and descriptors that keep the old bytes."""
    for report in check_shared_everywhere(fs_lab):
        assert report["fs"]["fstype"] == "fuse.juicefs"
        cross = report["cross"]
        assert cross["lock_scope"] == "cluster-wide" and cross["fresh_open_sees"]
        assert cross["descriptor_stale_s"] is not None and cross["descriptor_stale_s"] >= 3.0  # JuiceFS: stale
        assert cross["rename_visible_s"] is not None
        assert any("fresh descriptor" in note for note in report["notes"])
