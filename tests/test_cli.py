"""The operator CLI: inspect, fsck and fsck --rebuild on a real store, exit codes, bad paths; a pool shared by
writers in this process and a SIGKILLed writer process (synchronised on its replies, never on time)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from support import HostMemory, key, namespace, open_store, store_config

from sgl_kvtier.cli import main
from sgl_kvtier.sharing.lease import read_lease
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.store import format as fmt

ROOT = Path(__file__).resolve().parents[1]


def make_store(path, n=6):
    mem = HostMemory(n)
    with open_store(path) as store:
        for i in range(n):
            mem.fill(i, i)
        store.put([key(i) for i in range(n)], [mem.runs(i) for i in range(n)])
        return store.slot_bytes


def test_inspect_json(tmp_path, capsys):
    slot = make_store(tmp_path)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["pages"] == 6 and row["bytes_used"] == 6 * slot and row["format_version"] == fmt.FORMAT_VERSION
    assert row["devices"] == [str(tmp_path)] and row["locked_by_writer"] is None


def test_inspect_shows_a_live_writer(tmp_path, capsys):
    make_store(tmp_path)
    with open_store(tmp_path):
        assert main(["inspect", str(tmp_path), "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        assert row["locked_by_writer"] > 0


def test_fsck_finds_and_repairs(tmp_path, capsys):
    slot = make_store(tmp_path)
    assert main(["fsck", str(tmp_path)]) == 0
    (seg,) = tmp_path.glob("ns-*/w-*/seg-*.dat")
    with open(seg, "r+b") as f:
        f.seek(2 * slot + 10)
        f.write(b"\xff\xfe")
    capsys.readouterr()
    assert main(["fsck", str(tmp_path), "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["bad_pages"] == [key(2).hex()] and report["pages_checked"] == 6
    assert main(["fsck", str(tmp_path), "--repair"]) == 0
    assert main(["fsck", str(tmp_path)]) == 0


def test_fsck_rebuild_end_to_end(tmp_path, capsys):
    make_store(tmp_path)
    (meta,) = tmp_path.glob("ns-*/w-*")
    for p in [meta / "checkpoint.bin", *meta.glob("journal-*.log")]:
        p.unlink()
    capsys.readouterr()
    assert main(["fsck", str(tmp_path), "--rebuild", "--json"]) == 0
    (outcome,) = json.loads(capsys.readouterr().out)
    assert outcome["wid"] == meta.name[len("w-"):] and outcome["error"] is None
    assert outcome["report"]["pages"] == 6 and outcome["report"]["torn"] == 0
    assert main(["fsck", str(tmp_path), "--json"]) == 0  # every page verified against the rebuilt index
    (report,) = json.loads(capsys.readouterr().out)
    assert report["pages_checked"] == 6 and report["bad_pages"] == []
    mem = HostMemory(6)
    want = [mem.fill(i, i) for i in range(6)]
    mem.clear()
    with open_store(tmp_path) as store:
        assert store.get([key(i) for i in range(6)], [mem.runs(i) for i in range(6)]) == [True] * 6
        assert [mem.page(i).tobytes() for i in range(6)] == want
    assert main(["fsck", str(tmp_path), "--rebuild"]) == 0  # the table form
    assert "fsck --rebuild" in capsys.readouterr().out


def test_fsck_rebuild_leaves_a_live_writer_alone(tmp_path, capsys):
    make_store(tmp_path)
    with open_store(tmp_path):
        capsys.readouterr()
        assert main(["fsck", str(tmp_path), "--rebuild", "--json"]) == 1
        (outcome,) = json.loads(capsys.readouterr().out)
        assert outcome["report"] is None and "open for writing" in outcome["error"]


def test_fsck_rebuild_and_repair_are_exclusive(tmp_path, capsys):
    make_store(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["fsck", str(tmp_path), "--rebuild", "--repair"])
    assert exc.value.code == 2


def test_no_store_here(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no sgl-kvtier store" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- shared pools
SHARED_PAGE = 16 * 1024 - 4096  # a 16 KiB slot with its trailer (as tests/sharing/sharing_worker.py)
CAPACITY_PAGES = 256
WORKER = Path(__file__).parent / "sharing" / "sharing_worker.py"


def pool_config(path):
    # No beat during a test but the one at open and the ones it asks for: the files stay put while inspected.
    return store_config(path, CAPACITY_PAGES, SHARED_PAGE, follow_interval_s=0.0, heartbeat_s=600.0)


def put(pool, numbers):
    mem = HostMemory(len(numbers), SHARED_PAGE)
    for j, n in enumerate(numbers):
        mem.fill(j, n)
    assert pool.put([key(n) for n in numbers], [mem.runs(j) for j in range(len(numbers))]) == [True] * len(numbers)


def call(proc, op, **fields):
    proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
    proc.stdin.flush()
    out = json.loads(proc.stdout.readline())
    assert "error" not in out, out
    return out


def killed_writer(tmp_path):
    """A writer process that stored pages 100..107, beat its lease, and was SIGKILLed: (wid, pid). Started
    after the test's own writers (a writer opened later would adopt its free directory)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    try:
        info = call(proc, "open", path=str(tmp_path), role="writer", page_bytes=SHARED_PAGE,
                    capacity_pages=CAPACITY_PAGES, config={"follow_interval_s": 0.0, "heartbeat_s": 600.0})
        assert call(proc, "put", keys=list(range(100, 108)))["ok"] == [True] * 8
        call(proc, "beat")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return info["wid"], info["pid"]


def tree(root):
    """Every file under ``root``: (size, mtime_ns, xxh3 of its bytes), by path."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns, xxhash.xxh3_64_intdigest(p.read_bytes()))
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_inspect_shows_every_writer_of_a_pool(tmp_path, capsys):
    ns = namespace(SHARED_PAGE)
    with SharedPool.open_writer(pool_config(tmp_path), ns) as a, SharedPool.open_writer(pool_config(tmp_path), ns) as b:
        dead_wid, dead_pid = killed_writer(tmp_path)
        put(a, list(range(16)))
        put(b, list(range(200, 204)))
        a.own.lease.beat()
        b.own.lease.beat()
        before = tree(tmp_path)
        capsys.readouterr()
        assert main(["inspect", str(tmp_path), "--json"]) == 0
        (pool,) = json.loads(capsys.readouterr().out)
        assert main(["inspect", str(tmp_path)]) == 0
        text = capsys.readouterr().out
        assert tree(tmp_path) == before  # inspect wrote nothing, not even a LOCK
        wids = {a.wid: 16, b.wid: 4, dead_wid: 8}
    slot = a.slot_bytes
    assert pool["pages"] == 28 and pool["bytes_used"] == 28 * slot and pool["capacity_bytes"] == CAPACITY_PAGES * slot
    assert (pool["writers_live"], pool["writers_dead"], pool["writers_unknown"]) == (2, 1, 0)
    assert pool["lease_age_from"] == "LEASE mtime" and pool["problems"] == []
    rows = {w["wid"]: w for w in pool["writers"]}
    assert set(rows) == set(wids)
    for wid, pages in wids.items():
        w = rows[wid]
        assert w["state"] == ("dead" if wid == dead_wid else "live")
        assert w["pid"] == (dead_pid if wid == dead_wid else os.getpid())
        assert w["pages"] == pages and w["bytes_used"] == pages * slot and w["source"] == "index"
        assert w["leased_bytes_used"] == pages * slot  # each beat after its puts
        assert w["share_pct"] == round(100 * pages / CAPACITY_PAGES, 2)
        assert w["host"] == wid.rpartition("-")[0] and 0 <= w["lease_age_s"] < 600 and not w["lease_stale"]
        assert w["journal"][0] >= 0 and w["journal"][1] > 0 and w["beats"] >= 2
    assert pool["locked_by_writer"] == os.getpid()
    for word in ("28 pages", "2 live, 1 dead", "lease age", dead_wid, "dead", "6.2%"):
        assert word in text, (word, text)
    # Offline (every writer closed or killed): all dead, same pages.
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    (offline,) = json.loads(capsys.readouterr().out)
    assert (offline["writers_live"], offline["writers_dead"], offline["pages"]) == (0, 3, 28)
    assert offline["locked_by_writer"] is None


def test_inspect_shows_an_off_writer_live_with_no_lease(tmp_path, capsys, monkeypatch):
    """``sharing = "off"`` beats no lease: inspect judges the writer by its LOCK (live, its pid from there),
    never as dead for want of a lease; closed, it is dead with the same pages."""
    monkeypatch.setenv("COLUMNS", "200")  # the table's cells whole
    mem = HostMemory(3)
    with open_store(tmp_path, sharing="off") as store:
        for i in range(3):
            mem.fill(i, i)
        assert store.put([key(i) for i in range(3)], [mem.runs(i) for i in range(3)]) == [True] * 3
        before = tree(tmp_path)
        capsys.readouterr()
        assert main(["inspect", str(tmp_path), "--json"]) == 0
        (pool,) = json.loads(capsys.readouterr().out)
        assert main(["inspect", str(tmp_path)]) == 0
        text = capsys.readouterr().out
        assert tree(tmp_path) == before  # inspect wrote nothing
    (w,) = pool["writers"]
    assert (w["wid"], w["state"], w["pid"], w["sharing"]) == (store.wid, "live", os.getpid(), "off")
    assert w["lease_age_s"] is None and w["beats"] is None and w["leased_bytes_used"] is None and w["journal"] is None
    assert w["pages"] == 3 and w["source"] == "index" and w["host"] == store.wid.rpartition("-")[0]
    assert (pool["writers_live"], pool["writers_dead"], pool["pages"]) == (1, 0, 3)
    assert pool["locked_by_writer"] == os.getpid() and pool["problems"] == []
    assert "live (sharing off, no lease)" in text
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    (offline,) = json.loads(capsys.readouterr().out)
    assert offline["writers"][0]["state"] == "dead" and offline["writers"][0]["pid"] is None
    assert (offline["writers_live"], offline["pages"], offline["locked_by_writer"]) == (0, 3, None)


def corrupt(root, wid, slot_bytes, slot):
    (seg,) = root.glob(f"ns-*/w-{wid}/seg-*.dat")
    with open(seg, "r+b") as f:
        f.seek(slot * slot_bytes + 10)
        f.write(b"\xff\xfe")


def test_fsck_verifies_every_writer_and_repairs_only_dead_ones(tmp_path, capsys):
    ns = namespace(SHARED_PAGE)
    with SharedPool.open_writer(pool_config(tmp_path), ns) as live:
        dead_wid, _ = killed_writer(tmp_path)
        put(live, list(range(16)))
        assert main(["fsck", str(tmp_path), "--json"]) == 0
        reports = {r["wid"]: r for r in json.loads(capsys.readouterr().out)}
        assert {w: r["pages_checked"] for w, r in reports.items()} == {live.wid: 16, dead_wid: 8}
        with SharedPool.open_reader(pool_config(tmp_path), ns) as view:
            dead_slot = view.peers()[dead_wid].slot_of(key(103))
        corrupt(tmp_path, dead_wid, live.slot_bytes, dead_slot)
        corrupt(tmp_path, live.wid, live.slot_bytes, live.own.slot_of(key(5)))
        assert main(["fsck", str(tmp_path), "--repair", "--json"]) == 1  # the live writer stays damaged
        reports = {r["wid"]: r for r in json.loads(capsys.readouterr().out)}
        assert reports[dead_wid]["bad_pages"] == [key(103).hex()] and reports[dead_wid]["repaired"]
        assert reports[live.wid]["bad_pages"] == [key(5).hex()] and not reports[live.wid]["repaired"]
        assert reports[live.wid]["skipped"] == f"writer {live.wid} is live"
        assert main(["fsck", str(tmp_path), "--json"]) == 1
        reports = {r["wid"]: r for r in json.loads(capsys.readouterr().out)}
        assert reports[dead_wid]["bad_pages"] == [] and reports[dead_wid]["pages_checked"] == 7
    assert main(["fsck", str(tmp_path), "--repair"]) == 0  # now it is dead too
    assert main(["fsck", str(tmp_path)]) == 0


def test_repair_opens_the_damaged_writer_not_a_lower_free_one(tmp_path, capsys):
    """A claim takes the lowest free directory: repair of ``<host>-1`` holds ``<host>-0`` meanwhile."""
    ns = namespace(SHARED_PAGE)
    with SharedPool.open_writer(pool_config(tmp_path), ns) as first, \
            SharedPool.open_writer(pool_config(tmp_path), ns) as second:
        put(first, list(range(4)))
        put(second, list(range(10, 16)))
        victim, slot = second.wid, second.own.slot_of(key(12))
        slot_bytes = second.slot_bytes
    assert victim.endswith("-1")
    corrupt(tmp_path, victim, slot_bytes, slot)
    dirs = sorted(p.name for p in tmp_path.glob("ns-*/w-*"))
    assert main(["fsck", str(tmp_path), "--repair", "--json"]) == 0
    reports = {r["wid"]: r for r in json.loads(capsys.readouterr().out)}
    assert reports[victim]["repaired"] and not reports[first.wid]["repaired"]
    assert sorted(p.name for p in tmp_path.glob("ns-*/w-*")) == dirs  # no writer directory made
    assert main(["fsck", str(tmp_path), "--json"]) == 0
    reports = {r["wid"]: r for r in json.loads(capsys.readouterr().out)}
    assert {w: r["pages_checked"] for w, r in reports.items()} == {first.wid: 4, victim: 5}


# ---------------------------------------------------------------------------------------------- check-shared
def fake_mounts(monkeypatch, tmp_path, fstype):
    """``/proc/self/mountinfo`` reads as: / on ext4, ``tmp_path/pool`` on ``fstype``; that directory."""
    from sgl_kvtier.sharing.cluster_fs import detect as fs_detect

    pool = tmp_path / "pool"
    pool.mkdir()
    info = tmp_path / "mountinfo"
    info.write_text(f"1 0 999:999 / / rw - ext4 /dev/vda rw\n2 1 999:2 / {pool} rw - {fstype} array:/kv rw\n")
    monkeypatch.setattr(fs_detect, "MOUNTINFO", str(info))
    return pool


def test_check_shared_on_a_shared_filesystem(tmp_path, monkeypatch, capsys):
    pool = fake_mounts(monkeypatch, tmp_path, "nfs4")
    code = main(["check-shared", str(pool), "--json"])
    report = json.loads(capsys.readouterr().out)
    if not report["probes"][0]["ok"]:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    assert code == 0 and report["fit"] is True and report["problems"] == []
    assert (report["fs"]["fstype"], report["fs"]["fs_class"], report["fs"]["source"]) == ("nfs4", "shared", "array:/kv")
    assert main(["check-shared", str(pool)]) == 0
    out = capsys.readouterr().out
    assert "nfs4 (shared)" in out and "O_DIRECT: yes" in out and 'fit for sharing = "cluster"' in out
    assert list(pool.iterdir()) == []


def test_check_shared_on_a_local_filesystem_says_why_not(tmp_path, monkeypatch, capsys):
    pool = fake_mounts(monkeypatch, tmp_path, "xfs")
    assert main(["check-shared", str(pool)]) == 1
    out = capsys.readouterr().out
    assert "xfs (local only)" in out and 'not fit for sharing = "cluster"' in out
    assert "a filesystem only one host may mount" in out
    assert main(["check-shared", str(pool), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["fs"]["fs_class"] == "local_only"
    assert main(["check-shared", str(tmp_path / "missing")]) == 1
    assert "not a directory" in capsys.readouterr().out


def test_check_shared_with_no_peer_is_unfit(tmp_path, monkeypatch, capsys):
    pool = fake_mounts(monkeypatch, tmp_path, "lustre")
    assert main(["check-shared", str(pool), "--peer-wait", "0", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["peer"] is None and any("no other host's probe appeared in 0 s" in p for p in report["problems"])
    assert list(pool.iterdir()) == []


def test_check_shared_on_two_hosts_at_once_sees_the_other(tmp_path, monkeypatch, capsys):
    """Two checks at once, one a process standing for another machine (``KVTIER_BOOT_ID``): each sees the
    other's probe (synchronised by the probes themselves; each waits up to 60 s)."""
    pool = fake_mounts(monkeypatch, tmp_path, "nfs4")
    env = {**os.environ, "KVTIER_BOOT_ID": "machine-two", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "sgl_kvtier", "check-shared", str(pool), "--peer-wait", "60",
                             "--json"], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        code = main(["check-shared", str(pool), "--peer-wait", "60", "--json"])
        theirs = json.loads(proc.communicate(timeout=90)[0])
    finally:
        proc.kill()
        proc.wait()
    ours = json.loads(capsys.readouterr().out)
    assert ours["peer"]["boot_id"] == "machine-two" and theirs["peer"] is not None
    assert theirs["peer"]["pid"] == os.getpid()
    assert code == (0 if ours["probes"][0]["ok"] else 1)
    assert list(pool.iterdir()) == []


# ------------------------------------------------------------------------------------- an index that lost pages
def test_inspect_json_without_a_store_fails_as_the_table_does(tmp_path, capsys):
    assert main(["inspect", str(tmp_path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == []


def test_a_writer_whose_journal_and_checkpoint_are_gone_is_damage_only_rebuild_mends(tmp_path, capsys):
    """Its index reads as empty while its slots hold pages: fsck reports it, repair leaves it (it would fold
    the loss into a fresh checkpoint), and rebuild brings every page back."""
    make_store(tmp_path)
    (meta,) = tmp_path.glob("ns-*/w-*")
    for p in [meta / "checkpoint.bin", *meta.glob("journal-*.log")]:
        p.unlink()
    capsys.readouterr()
    assert main(["fsck", str(tmp_path), "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["index_incomplete"] and any("fsck --rebuild" in p for p in report["problems"])
    assert main(["fsck", str(tmp_path), "--repair", "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert not report["repaired"] and "fsck --rebuild" in report["skipped"]
    assert main(["fsck", str(tmp_path), "--rebuild"]) == 0
    capsys.readouterr()
    assert main(["fsck", str(tmp_path), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["pages_checked"] == 6 and report["problems"] == []


def test_repair_never_drops_the_pages_an_unreadable_checkpoint_listed(tmp_path, capsys):
    make_store(tmp_path)
    (meta,) = tmp_path.glob("ns-*/w-*")
    with open_store(tmp_path) as store:  # a fresh journal after the checkpoint: the pages are the checkpoint's
        assert len(store) == 6
    ckpt = meta / "checkpoint.bin"
    data = bytearray(ckpt.read_bytes())
    data[-1] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["fsck", str(tmp_path), "--repair", "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["index_incomplete"] and not report["repaired"] and "fsck --rebuild" in report["skipped"]
    assert main(["fsck", str(tmp_path), "--rebuild"]) == 0
    capsys.readouterr()
    assert main(["fsck", str(tmp_path), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["pages_checked"] == 6


def test_rebuild_leaves_another_hosts_writer_to_that_host(tmp_path, capsys):
    """Another host's writer is judged by no ``flock`` here: rebuild names the host instead of rewriting it."""
    make_store(tmp_path)
    (meta,) = tmp_path.glob("ns-*/w-*")
    lease = read_lease(meta / "LEASE")
    assert lease is not None
    other = {**lease, "host_id": "another-host", "machine_id": "0" * 32, "boot_id": "another-boot",
             "counter": int(lease["counter"]) + 1}
    (meta / "LEASE").write_bytes(fmt.pack_lease_block(other) * 2)
    for p in [meta / "checkpoint.bin", *meta.glob("journal-*.log")]:
        p.unlink()
    capsys.readouterr()
    assert main(["fsck", str(tmp_path), "--rebuild", "--json"]) == 1
    (outcome,) = json.loads(capsys.readouterr().out)
    assert outcome["report"] is None and "belongs to host another-host" in outcome["error"]
    assert not (meta / "checkpoint.bin").exists()  # nothing written
