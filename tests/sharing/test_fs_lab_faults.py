"""Faults under ``sharing = "cluster"`` on real hosts (``fs_lab``: JuiceFS mounted by two network namespaces,
redis as its metadata and data server), one lab for the module; each test leaves it whole (a fault undone in
``finally`` or by its context manager). Writers are ``sharing_worker.py`` processes on the hosts; every page
read is checked byte for byte (a wrong byte fails at once), and no call may answer an error.

Each fault ends with the pool serving again: waits poll a condition against a named deadline, never a fixed
sleep. The faults: host A's link cut with a put in flight; A's JuiceFS client killed and mounted again; the
metadata server crashed and restarted; a writer SIGKILLed; both hosts writing far past the pool quota.
(A writer paused past ``dead_after_s`` is test_fs_lab.py's.)
"""

from __future__ import annotations

import select
import time
from typing import Any

import pytest
from test_fs_lab import HostProc, on_host, open_writer, pool_dir, served, wait_stats  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow

# Short liveness, so a silent writer is retired within about two seconds; breakers that reopen fast.
FAST = {"sharing": "cluster", "heartbeat_s": 0.25, "dead_after_s": 1.0, "reclaim_after_s": 1.0,
        "breaker_cooldown_s": 0.25}
# No writer is judged dead across a short stall of the whole filesystem (the metadata server restarting).
STEADY = {"sharing": "cluster", "heartbeat_s": 0.25, "dead_after_s": 60.0, "reclaim_after_s": 600.0,
          "breaker_cooldown_s": 0.25}
RECOVER_S = 30.0  # longest the pool may take to serve and store again once a fault is over
PUT_S = 30.0  # longest a put in flight through a fault may take to return once the fault is over
CAP = 48  # pool quota of the quota test, in pages (capacity_bytes = CAP slots)


def reply_within(proc: HostProc, timeout_s: float, what: str) -> dict[str, Any]:
    """The reply to the call in flight on ``proc``; fails when none came within ``timeout_s`` (a hang)."""
    assert proc.p.stdout is not None
    ready, _, _ = select.select([proc.p.stdout], [], [], timeout_s)
    assert ready, f"{what}: no reply within {timeout_s:g} s"
    return proc.recv()


def checked_get(proc: HostProc, keys: list[int]) -> dict[str, list[int]]:
    """``get`` on ``proc``: never an error (``Proc.recv``), never a wrong byte."""
    seen = proc.call("get", keys=keys)
    assert seen["wrong"] == [], f"wrong bytes served for {seen['wrong']}"
    return seen


def stored(proc: HostProc, keys: list[int], timeout_s: float = RECOVER_S) -> None:
    """Put ``keys`` on ``proc`` until every one is stored (a page stored already counts: present), within
    ``timeout_s``; every put answers, never an error."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok = proc.call("put", keys=keys)["ok"]
        if all(ok):
            return
        assert time.monotonic() < deadline, f"{keys[0]}..: not stored within {timeout_s:g} s ({ok})"
        time.sleep(0.1)  # the poll's pace: breakers and re-registration retries run on their own clocks


def retired(b: HostProc, wid: str) -> dict[str, Any]:
    """Poll ``b`` (refresh, stats) until it retired writer ``wid`` and no longer follows it."""
    return wait_stats(b, lambda s: s["sharing"]["writers_retired"] >= 1 and wid not in s["peers"],
                      f"{b.host.hostname} retiring {wid}", RECOVER_S, step=lambda: b.call("refresh"))


def test_a_host_cut_off_with_a_put_in_flight_gets_its_answer_and_both_hosts_serve_again(fs_lab, on_host):  # noqa: F811
    """A's link goes down with a put in flight and stays down until B retired A (silent past dead_after_s);
    the put returns, without an error, once the link is back; A re-registers and both serve again."""
    path = pool_dir(fs_lab, "cut")
    a, b = on_host(0), on_host(1)
    old = open_writer(a, path, 64, FAST)
    open_writer(b, path, 64, FAST)
    before = list(range(10))
    assert a.call("put", keys=before)["ok"] == [True] * 10
    assert served(b, before, 10) == before
    with fs_lab.cut(fs_lab.hosts[0]):
        a.send("put", keys=list(range(10, 20)))  # through the cut: A's client reaches no server
        retired(b, old)
        assert checked_get(b, before)["hits"] == []  # A's pages are gone with it: misses
    back = time.monotonic()
    answer = reply_within(a, PUT_S, "A's put through the cut")
    print(f"cut: A's put answered {time.monotonic() - back:.2f} s after the link came back: {answer['ok']}")
    assert len(answer["ok"]) == 10
    stats = wait_stats(a, lambda s: s["sharing"]["reregistrations"] >= 1, "A re-registering", RECOVER_S,
                       step=lambda: a.call("put", keys=[1000]))
    assert stats["wid"].startswith("labhost0-")
    fresh, theirs = list(range(100, 110)), list(range(200, 210))
    stored(a, fresh)
    stored(b, theirs)
    assert served(b, fresh, 10, RECOVER_S) == fresh
    assert served(a, theirs, 10, RECOVER_S) == theirs


def test_a_host_whose_filesystem_client_died_degrades_then_serves_and_writes_once_mounted_again(fs_lab, on_host):  # noqa: F811
    """A's JuiceFS client is SIGKILLed: A's puts are refused and its reads miss (no error), B serves its own
    pages; once the volume is mounted again, A's writer re-registers (its old descriptors answer ENOTCONN for
    good) and both hosts serve each other's new pages."""
    path = pool_dir(fs_lab, "client")
    a, b = on_host(0), on_host(1)
    open_writer(a, path, 64, FAST)
    open_writer(b, path, 64, FAST)
    first, mine = list(range(10)), list(range(100, 110))
    assert a.call("put", keys=first)["ok"] == [True] * 10
    assert b.call("put", keys=mine)["ok"] == [True] * 10
    assert served(b, first, 10) == first and served(a, mine, 10) == mine
    host = fs_lab.hosts[0]
    fs_lab.kill_client(host)
    try:
        assert a.call("put", keys=list(range(10, 20)))["ok"] == [False] * 10  # refused, never an error
        assert checked_get(a, first + mine)["hits"] == []
        assert set(mine) <= set(checked_get(b, mine + first)["hits"])  # B serves what it holds
    finally:
        fs_lab.remount(host)
    back = time.monotonic()
    fresh, theirs = list(range(200, 210)), list(range(300, 310))
    stored(a, fresh)
    stats = a.call("stats")
    print(f"client killed: A stores again {time.monotonic() - back:.2f} s after the remount as {stats['wid']}")
    assert stats["sharing"]["reregistrations"] == 1
    stored(b, theirs)
    assert served(b, fresh, 10, RECOVER_S) == fresh
    assert served(a, theirs, 10, RECOVER_S) == theirs
    assert served(a, mine, 10, RECOVER_S) == mine  # B's pages read before the kill: through fresh descriptors


def test_the_metadata_server_crashed_and_restarted_keeps_every_page_and_the_pool_serves_again(fs_lab, on_host):  # noqa: F811
    """redis is SIGKILLed with a put in flight and started again on its append-only file: the put answers,
    every page put before is still served byte-exact on both hosts, and new pages are stored and served."""
    path = pool_dir(fs_lab, "meta")
    a, b = on_host(0), on_host(1)
    open_writer(a, path, 64, STEADY)
    open_writer(b, path, 64, STEADY)
    theirs, mine = list(range(10)), list(range(100, 110))
    assert a.call("put", keys=theirs)["ok"] == [True] * 10
    assert b.call("put", keys=mine)["ok"] == [True] * 10
    assert served(b, theirs, 10) == theirs and served(a, mine, 10) == mine
    a.send("put", keys=list(range(10, 20)))
    fs_lab.restart_meta()
    back = time.monotonic()
    assert len(reply_within(a, PUT_S, "A's put across the restart")["ok"]) == 10
    assert served(b, theirs, 10, RECOVER_S) == theirs
    assert served(a, mine, 10, RECOVER_S) == mine
    fresh = list(range(200, 210))
    stored(a, fresh)
    assert served(b, fresh, 10, RECOVER_S) == fresh
    print(f"metadata restart: old and new pages served {time.monotonic() - back:.2f} s after redis answered")
    assert a.call("stats")["sharing"]["reregistrations"] == 0  # nobody was retired over it


def test_a_writer_killed_is_retired_by_the_other_host_its_pages_miss_and_a_new_writer_registers(fs_lab, on_host):  # noqa: F811
    path = pool_dir(fs_lab, "killed")
    a, b = on_host(0), on_host(1)
    old = open_writer(a, path, 64, FAST)
    open_writer(b, path, 64, FAST)
    keys = list(range(10))
    assert a.call("put", keys=keys)["ok"] == [True] * 10
    assert served(b, keys, 10) == keys
    a.kill()  # SIGKILL: its LOCK is released, its lease stops
    wait_stats(b, lambda s: s["sharing"]["writers_retired"] >= 1 and old not in s["peers"],
               f"{b.host.hostname} retiring {old}", RECOVER_S, step=lambda: checked_get(b, keys))  # never an error
    assert checked_get(b, keys)["hits"] == []
    c = on_host(0)
    wid = open_writer(c, path, 64, FAST)
    assert wid.startswith("labhost0-")
    fresh = list(range(100, 110))
    assert c.call("put", keys=fresh)["ok"] == [True] * 10
    assert served(b, fresh, 10) == fresh
    assert b.call("stats")["peers"] == [wid] and checked_get(c, keys)["hits"] == []


def test_the_pool_quota_holds_across_both_hosts_writing_far_past_it(fs_lab, on_host):  # noqa: F811
    """Both hosts put 3x the pool's quota each at once, in rounds of a third of it; after each round the pool
    is back within its quota in total (own pages of A plus B) within the deadline, at the end too, and both
    hold pages (the pool's newest: the quota evicts the oldest first) that the other serves byte-exact. Right
    after a round the total may overshoot: a writer counts the other's bytes as its lease last announced."""
    path = pool_dir(fs_lab, "quota")
    a, b = on_host(0), on_host(1)
    open_writer(a, path, CAP, STEADY)
    open_writer(b, path, CAP, STEADY)
    rounds, per_round = 9, CAP // 3
    peak = 0
    for r in range(rounds):
        a.send("put", keys=list(range(r * per_round, (r + 1) * per_round)))
        b.send("put", keys=list(range(10_000 + r * per_round, 10_000 + (r + 1) * per_round)))
        a.recv(), b.recv()  # both rounds ran at once
        peak = max(peak, a.call("stats")["own"] + b.call("stats")["own"])
        wait_stats(a, lambda s: s["own"] + b.call("stats")["own"] <= CAP, f"round {r}: the pool within {CAP} pages",
                   RECOVER_S)
    held_a, held_b = a.call("stats")["own_keys"], b.call("stats")["own_keys"]
    print(f"quota: {CAP} pages; A holds {len(held_a)}, B {len(held_b)}; peak after a round {peak}")
    assert len(held_a) + len(held_b) <= CAP and held_a and held_b
    # The oldest go first: what each holds is among its newest CAP pages. (How far below the quota the pool
    # ends depends on how stale each writer's view of the other was when both evicted at once.)
    assert min(held_a) >= rounds * per_round - CAP and min(held_b) >= 10_000 + rounds * per_round - CAP
    serves_what_the_other_holds(a, b)
    serves_what_the_other_holds(b, a)


def serves_what_the_other_holds(owner: HostProc, reader: HostProc) -> None:
    """``reader`` serves every page ``owner`` holds both before and after the read (the quota may still
    evict between), byte for byte, within the deadline."""
    deadline = time.monotonic() + RECOVER_S
    while True:
        before = set(owner.call("stats")["own_keys"])
        reader.call("refresh")
        hits = set(checked_get(reader, sorted(before))["hits"])
        held = before & set(owner.call("stats")["own_keys"])
        if held <= hits:
            return
        assert time.monotonic() < deadline, f"{sorted(held - hits)} held by the owner, not served"
        time.sleep(0.1)  # the poll's pace: leases announce on their own clock
