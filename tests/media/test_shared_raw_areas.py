"""A shared raw pool's meta areas (``media.shared_raw.region_meta``): O_DIRECT everywhere, torn or stale areas, journal
area rotation and its refusal, another host in a process of its own, and the offline tools.

Same conventions as ``test_shared_raw.py`` (a regular file for the device, idle lease threads, injected
clocks, no sleeps). Damage is done by writing the pool file directly, as a torn write or a bad sector would.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path

import numpy as np
import pytest
from sharing_worker import page
from support import HostMemory, key
from test_liveness import DEAD_S, Clock
from test_shared_raw import BOOT, NS, PAGE, pool_file, put, raw_config, read

from sgl_kvtier.cli import main
from sgl_kvtier.media.shared_raw.region_meta import RegionFiles
from sgl_kvtier.media.shared_raw.regions import region_of
from sgl_kvtier.media.shared_raw.superblock import open_direct, read_host_lease, superblock_of
from sgl_kvtier.sharing import shared_raw_claim as pool_claim
from sgl_kvtier.sharing.lease import read_lease
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import journal as jr


def damage(dev: str, at: int, data: bytes = b"\xa5" * 64) -> None:
    with open(dev, "r+b") as f:
        f.seek(at)
        f.write(data)


def put_many(store, numbers: list[int], batch: int = 16) -> list[int]:
    """Put ``numbers`` in batches; the ones acknowledged (a batch whose checkpoint failed after its records
    were synced raised: not counted, though it may be stored)."""
    mem = HostMemory(batch, PAGE)
    acked: list[int] = []
    for start in range(0, len(numbers), batch):
        chunk = numbers[start:start + batch]
        for j, n in enumerate(chunk):
            mem.page(j)[:] = np.frombuffer(page(n, PAGE), dtype=np.uint8)
        try:
            oks = store.put([key(n) for n in chunk], [mem.runs(j) for j in range(len(chunk))])
        except OSError:
            continue
        acked += [n for n, ok in zip(chunk, oks) if ok]
    return acked


def test_every_descriptor_on_a_shared_raw_pool_is_o_direct(tmp_path, monkeypatch):
    dev = pool_file(tmp_path)
    opened: list[int] = []
    real_open, real_builtin = os.open, open

    def os_open(path, flags, *rest, **kw):
        fd = real_open(path, flags, *rest, **kw)
        if str(path) == dev:
            opened.append(flags)
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT, f"{path} opened without O_DIRECT"
        return fd

    def builtin_open(path, *args, **kwargs):
        assert str(path) != dev, "a pool device read through the page cache"
        return real_builtin(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr("builtins.open", builtin_open)
    monkeypatch.setenv(BOOT, "boot-a")
    with SharedPool.open_writer(raw_config(dev, 0, "ha", checkpoint_interval=8), NS) as a:
        assert put(a, list(range(20))) == [True] * 20
        a.own.lease.beat()
        monkeypatch.setenv(BOOT, "boot-b")
        with SharedPool.open_writer(raw_config(dev, 1, "hb"), NS) as b:
            assert read(b, list(range(20))) == (list(range(20)), [], [])
            b.own.lease.beat()
            a.refresh(force=True)
            for store in (a.own, b.own):
                for fd in [*store.layout.arenas[0].fds(), store.layout.files.fd]:
                    assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    assert main(["inspect", dev, "--json"]) == 0 and main(["fsck", dev, "--json"]) == 0
    assert len(opened) > 20 and all(flags & os.O_DIRECT for flags in opened)


def region_files(dev: str, wid: str = "ha-0") -> RegionFiles:
    """A read-only view of writer ``wid``'s areas (close it)."""
    found = region_of(Path(dev) / NS.dirname() / f"w-{wid}")
    assert found is not None
    return RegionFiles(found[0], found[1], found[2], Path(dev) / NS.dirname() / f"w-{wid}", writable=False)


def area_file(dev: str, name: str) -> bytes:
    """What a reader sees of writer ha-0's file ``name`` (FileNotFoundError: none)."""
    view = region_files(dev)
    try:
        return view.read(view.path / name)
    finally:
        view.close()


def test_a_torn_lease_block_is_the_older_lease_and_two_are_none(tmp_path):
    dev = pool_file(tmp_path)
    with SharedPool.open_writer(raw_config(dev, 0, "ha"), NS) as a:
        a.own.lease.beat()
        a.own.lease.beat()
        path = a.own.layout.meta / "LEASE"
        newest = read_lease(path)
        assert newest is not None and newest["host_index"] == 0 and newest["wid"] == "ha-0"
        at = a.own.layout.files.region.at(fmt.REGION_LEASE_AT)
        damage(dev, at + (newest["counter"] % 2) * fmt.LEASE_BLOCK_BYTES + 100)
        older = read_lease(path)
        assert older is not None and older["counter"] == newest["counter"] - 1
        damage(dev, at + (older["counter"] % 2) * fmt.LEASE_BLOCK_BYTES + 100)
        assert read_lease(path) is None


@pytest.mark.parametrize("where", ["bytes", "header", "both"])
def test_a_torn_checkpoint_area_is_the_older_checkpoint_or_the_journals(tmp_path, where):
    dev = pool_file(tmp_path)
    cfg = raw_config(dev, 0, "ha")
    with SharedPool.open_writer(cfg, NS) as a:
        assert put(a, list(range(10))) == [True] * 10
        a.checkpoint()
        assert put(a, list(range(10, 20))) == [True] * 10
        a.checkpoint()
        files = a.own.layout.files
        serials = [files._checkpoint_head(i, verify=True) for i in range(2)]
        a.own.fenced = "test: no checkpoint at close"  # keep the two checkpoints as they are
    newest = max(range(2), key=lambda i: serials[i][0])
    region = files.region
    newest_blob = area_file(dev, "checkpoint.bin")
    for i in ([newest] if where != "both" else [0, 1]):
        damage(dev, region.checkpoint_at(i) + (fmt.POOL_BLOCK + 200 if where != "header" else 10))
    if where == "both":
        with pytest.raises(FileNotFoundError):
            area_file(dev, "checkpoint.bin")
    else:
        got = area_file(dev, "checkpoint.bin")
        assert fmt.unpack_checkpoint(got, "test")["generation"] == serials[1 - newest][1] and got != newest_blob
    with SharedPool.open_writer(cfg, NS) as a:  # the journals the older one does not cover are all there
        assert read(a, list(range(20))) == (list(range(20)), [], [])


def test_a_torn_journal_record_stops_replay_there_never_garbage(tmp_path):
    dev = pool_file(tmp_path)
    cfg = raw_config(dev, 0, "ha")
    with SharedPool.open_writer(cfg, NS) as a:
        assert put(a, list(range(30))) == [True] * 30
        journal = a.own._journal
        at = a.own.layout.files.region.journal_at(journal.generation % fmt.JOURNAL_AREAS)
        a.own.fenced = "test: no checkpoint at close"
    damage(dev, at + journal.synced // 2, b"\xff" * 8)
    with SharedPool.open_writer(cfg, NS) as a:
        hits, misses, wrong = read(a, list(range(30)))
        assert wrong == [] and hits == list(range(len(hits))) and 5 < len(hits) < 30 and misses == list(range(len(hits), 30))


def test_records_of_an_older_generation_left_in_a_reused_area_never_replay(tmp_path):
    dev = pool_file(tmp_path)
    with open_writer(raw_config(dev, 0, "ha"), NS) as store:
        files = store.layout.files
        first = store._journal.generation
        assert put_many(store, list(range(40))) == list(range(40))  # a long generation ``first``
        for _ in range(fmt.JOURNAL_AREAS):  # rotate until ``first``'s area is taken again
            store.checkpoint()
        gen = store._journal.generation
        assert gen % fmt.JOURNAL_AREAS == first % fmt.JOURNAL_AREAS and files.may_rotate(gen + 1)
        assert put_many(store, [100, 101]) == [100, 101]  # a short tail over ``first``'s records
        store.fenced = "test: no checkpoint at close"
    with pytest.raises(FileNotFoundError):
        area_file(dev, f"journal-{first:08d}.log")
    view = region_files(dev)
    try:
        state = jr.Recovered()
        jr._replay(view.path / f"journal-{gen:08d}.log", state, view=view)
    finally:
        view.close()
    assert state.replayed_records == 2 and sorted(state.slot_of) == [key(100), key(101)]


def test_journal_areas_rotate_and_an_area_the_checkpoint_does_not_cover_is_never_taken(tmp_path, monkeypatch):
    dev = pool_file(tmp_path)
    cfg = raw_config(dev, 0, "ha", capacity_pages=512, checkpoint_interval=1000)
    with open_writer(cfg, NS) as store:
        files = store.layout.files

        def failing(blob: bytes, generation: int) -> None:
            raise OSError(errno.EIO, "checkpoint area unwritable (test)")

        monkeypatch.setattr(files, "write_checkpoint", failing)
        start = store._journal.generation
        for _ in range(fmt.JOURNAL_AREAS + 2):
            with pytest.raises(OSError):
                store.checkpoint()
        gen = store._journal.generation
        assert gen == start + fmt.JOURNAL_AREAS - 1  # rotated while the durable checkpoint covered the area
        assert not files.may_rotate(gen + 1)
        with pytest.raises(OSError) as refused:
            files.open_journal(gen + 1)
        assert refused.value.errno == errno.EBUSY and "does not cover" in str(refused.value)
        put_many(store, list(range(3000)))  # the area fills: puts are refused, never an error
        assert store._journal.generation == gen and store.counters.put_no_space > 0
        assert put_many(store, list(range(5000, 5016))) == [] and store._journal.room() < 64 << 10
        monkeypatch.undo()
        store.checkpoint()  # in place first, then it rotates again
        assert store._journal.generation == gen + 1 and put_many(store, [6000]) == [6000]
        kept = sorted(int.from_bytes(k[:4], "little") for k in store.keys())
    assert 6000 in kept and len(kept) > 100
    with open_writer(cfg, NS) as store:
        assert read(store, kept) == (kept, [], [])


def test_another_host_in_a_process_of_its_own_is_read_and_judged_by_its_lease(tmp_path, hostproc, monkeypatch):
    dev = pool_file(tmp_path)
    cfg_b = {k: v for k, v in raw_config(dev, 1, "hb").to_mapping().items() if k not in ("devices", "capacity_bytes")}
    proc = hostproc("boot-b")
    assert proc.call("open", path=dev, page_bytes=PAGE, role="writer", capacity_pages=48, config=cfg_b)["wid"] == "hb-0"
    assert proc.call("put", keys=list(range(100, 116)))["ok"] == [True] * 16
    proc.call("beat")
    monkeypatch.setenv(BOOT, "boot-a")
    clock = Clock()
    with SharedPool.open_writer(raw_config(dev, 0, "ha"), NS, clock=clock) as a:
        assert read(a, list(range(100, 116))) == (list(range(100, 116)), [], [])
        assert put(a, [1]) == [True]
        a.own.lease.beat()
        assert proc.call("get", keys=[1])["hits"] == [1]  # b reads a's page after a's beat
        proc.kill()
        clock.t += DEAD_S + 1
        a.refresh(force=True)
        assert a.verdict("hb-0").verdict.value == "dead" and not a.verdict("hb-0").same_host
        assert read(a, list(range(100, 116))) == (list(range(100, 116)), [], [])  # a dead host's pages stay
    again = hostproc("boot-b")  # host 1 starts again: its writer adopts its region, warm
    assert again.call("open", path=dev, page_bytes=PAGE, role="writer", capacity_pages=48, config=cfg_b)["wid"] == "hb-0"
    assert again.call("get", keys=list(range(100, 116)))["hits"] == list(range(100, 116))


def test_inspect_and_fsck_show_and_verify_every_hosts_writers(tmp_path, monkeypatch, capsys):
    dev = pool_file(tmp_path)
    for h, host in ((0, "ha"), (1, "hb")):
        monkeypatch.setenv(BOOT, f"boot-{host}")
        with SharedPool.open_writer(raw_config(dev, h, host), NS) as pool:
            assert put(pool, list(range(h * 100, h * 100 + 6))) == [True] * 6
    capsys.readouterr()
    assert main(["inspect", dev, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown) == 1 and shown[0]["pages"] == 12
    writers = {w["wid"]: w for w in shown[0]["writers"]}
    assert sorted(writers) == ["ha-0", "hb-0"] and {w["pages"] for w in writers.values()} == {6}
    assert writers["hb-0"]["host"] == "hb" and writers["hb-0"]["state"] == "dead" and writers["ha-0"]["beats"] >= 1
    assert main(["fsck", dev, "--json"]) == 0
    assert {r["wid"]: r["pages_checked"] for r in json.loads(capsys.readouterr().out)} == {"ha-0": 6, "hb-0": 6}
    found = region_of(Path(dev) / NS.dirname() / "w-hb-0")
    assert found is not None
    damage(dev, found[2].data_at + 100)  # hb's first page (slot 0): bad bytes
    assert main(["fsck", dev, "--repair", "--json"]) == 0  # hb-0 is a dead writer of this machine: repaired
    reports = {r["wid"]: r for r in json.loads(capsys.readouterr().out)}
    assert reports["hb-0"]["repaired"] and len(reports["hb-0"]["bad_pages"]) == 1 and reports["ha-0"]["bad_pages"] == []
    assert main(["fsck", dev, "--rebuild", "--json"]) == 1
    assert "not available for a shared raw pool" in capsys.readouterr().out
    assert superblock_of(dev) is not None


def test_the_pool_format_command_shows_then_writes(tmp_path, capsys):
    dev = tmp_path / "ns.img"
    dev.write_bytes(bytes(16 << 20))
    assert main(["pool-format", str(dev), "--hosts", "2", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["written"] is False and superblock_of(str(dev)) is None
    assert main(["pool-format", str(dev), "--hosts", "2", "--yes"]) == 0
    assert "host_index (0..1)" in capsys.readouterr().out and superblock_of(str(dev)).hosts == 2
    assert main(["pool-format", str(dev), "--hosts", "2", "--yes"]) == 1
    assert "is a shared raw pool already" in " ".join(capsys.readouterr().out.split())


def test_a_torn_host_lease_is_the_older_one_and_two_leave_the_slot_free(tmp_path, monkeypatch):
    dev = pool_file(tmp_path)
    sb = superblock_of(dev)
    monkeypatch.setenv(BOOT, "boot-a")
    with SharedPool.open_writer(raw_config(dev, 0, "ha"), NS) as a:
        a.own.lease.beat()
        fd = open_direct(dev, False)
        try:
            newest = read_host_lease(fd, sb, 0)
            assert newest is not None and newest["host_id"] == "ha" and newest["boot_id"] == "boot-a"
            damage(dev, sb.slot_at(0) + (newest["counter"] % 2) * fmt.POOL_BLOCK + 40)
            older = read_host_lease(fd, sb, 0)
            assert older is not None and older["counter"] == newest["counter"] - 1
            damage(dev, sb.slot_at(0) + (older["counter"] % 2) * fmt.POOL_BLOCK + 40)
            assert read_host_lease(fd, sb, 0) is None
        finally:
            os.close(fd)
        a.own.fenced = "test: no checkpoint at close"
    monkeypatch.setenv(BOOT, "boot-b")
    watch = pool_claim.HostWatch(lambda: 0.0, lambda s: pytest.fail("no lease to watch"))
    claim = pool_claim.claim(raw_config(dev, 0, "hb"), NS, watch=watch)  # nothing beats there: taken at once
    claim.release()
