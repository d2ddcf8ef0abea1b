"""Many writer processes share one namespace's pool (format 2): real processes, real files, no sleeps.

Each process is ``sharing_worker.py`` driven over pipes; tests synchronise on its replies (and kill it
with SIGKILL after a chosen number of acknowledged batches), never on time. Pages are derived from their
key number, so every read is checked byte for byte.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash
from support import HostMemory, key, namespace, store_config

from sgl_kvtier.errors import DeviceError, StoreFormatError
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store import journal_write as jw

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("sharing_worker.py")
PAGE = 16 * 1024 - 4096  # a 16 KiB slot with its trailer


class Proc:
    """One pool process (``sharing_worker.py``)."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
        self.p = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env, cwd=ROOT)

    def send(self, op: str, **fields: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.p.stdin.flush()

    def recv(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        assert line, f"worker {self.p.pid} died (rc {self.p.poll()})"
        out: dict[str, Any] = json.loads(line)
        assert "error" not in out, out
        return out

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.send(op, **fields)
        return self.recv()

    def kill(self) -> None:
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.call("quit")
            assert self.p.stdin is not None
            self.p.stdin.close()
            self.p.wait(timeout=60)


@pytest.fixture
def procs():
    made: list[Proc] = []

    def start(n: int = 1) -> list[Proc]:
        new = [Proc() for _ in range(n)]
        made.extend(new)
        return new

    yield start
    for proc in made:
        if proc.p.poll() is None:
            proc.kill()


def opened(proc: Proc, path: Path, role: str = "writer", **config: Any) -> dict[str, Any]:
    capacity = config.pop("capacity_pages", 256)
    return proc.call("open", path=str(path), role=role, page_bytes=PAGE, capacity_pages=capacity,
                     config={"follow_interval_s": 0.0, **config})


def start_all(ps: list[Proc], path: Path, **config: Any) -> list[dict[str, Any]]:
    capacity = config.pop("capacity_pages", 256)
    for proc in ps:  # every open is under way before any reply is read: they race
        proc.send("open", path=str(path), role="writer", page_bytes=PAGE, capacity_pages=capacity,
                  config={"follow_interval_s": 0.0, **config})
    return [proc.recv() for proc in ps]


# ---------------------------------------------------------------------- writers started at once
def test_writers_started_at_once_all_succeed_and_serve_each_other(tmp_path, procs):
    ps = procs(4)
    infos = start_all(ps, tmp_path)
    assert len({i["wid"] for i in infos}) == 4 and len({i["store_id"] for i in infos}) == 1
    ranges = [list(range(100 * w, 100 * w + 16)) for w in range(4)]
    for proc, numbers in zip(ps, ranges):
        assert proc.call("put", keys=numbers)["ok"] == [True] * 16
    for w, proc in enumerate(ps):
        others = [n for v, numbers in enumerate(ranges) if v != w for n in numbers]
        seen = proc.call("get", keys=others)
        assert seen["wrong"] == [] and seen["misses"] == [] and len(seen["hits"]) == 48
        assert proc.call("prefix", keys=others)["n"] == 48  # one chain over three other writers
    for proc in ps:
        proc.call("close")
        proc.stop()


def test_concurrent_first_open_makes_one_store_id(tmp_path, procs):
    devices = [tmp_path / "d0", tmp_path / "d1"]
    for d in devices:
        d.mkdir()
    infos = start_all(procs(4), tmp_path / "d0", devices=[str(d) for d in devices], meta_dir=str(tmp_path))
    assert len({i["store_id"] for i in infos}) == 1
    headers = [tmp_path / f"ns-{namespace(PAGE).digest().hex()}" / "HEADER",
               *(d / f"ns-{namespace(PAGE).digest().hex()}" / "HEADER" for d in devices)]
    ids = {fmt.unpack_header(fmt.HEADER_MAGIC, h.read_bytes(), str(h))["store_id"] for h in headers}
    assert ids == {infos[0]["store_id"]}
    assert not list(tmp_path.rglob(".HEADER.*.tmp"))  # every loser's private copy is gone


# ---------------------------------------------------------------------- dedupe, cap
def test_put_skips_keys_a_peer_holds(tmp_path, procs):
    a, b = procs(2)
    opened(a, tmp_path)
    opened(b, tmp_path)
    numbers = list(range(24))
    assert a.call("put", keys=numbers)["ok"] == [True] * 24
    assert b.call("put", keys=numbers + [500, 501])["ok"] == [True] * 26
    stats = b.call("stats")
    assert stats["own_keys"] == [500, 501]  # the second writer stored nothing the first holds
    assert stats["counters"]["put_present"] == 24 and stats["counters"]["put_pages"] == 2
    assert b.call("get", keys=numbers)["hits"] == numbers


def test_the_pool_cap_is_held_by_two_writers(tmp_path, procs):
    a, b = procs(2)
    quota_off = {"quota_high": 1.0, "quota_low": 1.0}  # the hard cap alone (the quota: test_quota_pool.py)
    opened(a, tmp_path, capacity_pages=16, eviction="lru", **quota_off)
    opened(b, tmp_path, capacity_pages=16, eviction="lru", **quota_off)
    assert a.call("put", keys=list(range(12)))["ok"] == [True] * 12
    a.call("beat")  # A's lease now says 12 pages
    b.call("refresh")
    ok = b.call("put", keys=list(range(100, 112)))["ok"]  # two batches: 8 pages, then 4
    # Room for 4 in the pool: B's first batch has nothing of its own to evict for the other 4; its
    # second batch pays with B's own coldest pages, never with A's.
    assert ok == [True] * 4 + [False] * 4 + [True] * 4
    stats = b.call("stats")
    assert stats["counters"]["put_no_space"] == 4 and stats["own_keys"] == list(range(108, 112))
    b.call("beat")
    a.call("refresh")
    assert a.call("put", keys=list(range(200, 204)))["ok"] == [True] * 4  # A pays with its own coldest
    sa, sb = a.call("stats"), b.call("stats")
    assert sa["own"] == 12 and sb["own"] == 4 and sa["counters"]["evictions"] == 4
    assert sa["own_keys"] == [*range(4, 12), *range(200, 204)]


# ---------------------------------------------------------------------- crashes
def test_a_sigkilled_writers_pages_stay_readable_and_restart_takes_its_dir_back(tmp_path, procs):
    a, b = procs(2)
    wid_a = opened(a, tmp_path)["wid"]
    opened(b, tmp_path)
    numbers = list(range(40))
    assert a.call("put", keys=numbers)["ok"] == [True] * 40
    a.kill()
    seen = b.call("get", keys=numbers)
    assert seen["hits"] == numbers and seen["wrong"] == []
    (again,) = procs(1)
    assert opened(again, tmp_path)["wid"] == wid_a  # the lowest free directory: its own
    stats = again.call("stats")
    assert stats["own_keys"] == numbers  # warm: its pages are still its own
    assert again.call("get", keys=numbers)["hits"] == numbers


def test_writers_and_readers_with_sigkills_never_serve_wrong_bytes(tmp_path, procs):
    rng = random.Random(12)
    big = {"capacity_pages": 1024}  # nothing is evicted: every acknowledged page must stay
    writers = procs(2)
    for w in writers:
        opened(w, tmp_path, **big)
    (reader,) = procs(1)
    opened(reader, tmp_path, role="reader", **big)
    acked: set[int] = set()
    for round_ in range(3):
        base = 10_000 * round_
        ranges = [list(range(base + 1000 * w, base + 1000 * w + 64)) for w in range(2)]
        for w, numbers in zip(writers, ranges):
            w.send("churn", keys=numbers)
        victim = rng.randrange(2)
        kill_after = rng.randrange(1, 8)  # of its 8 batches
        reader.send("read_loop", keys=sorted(acked) or [0], rounds=3)
        for i, w in enumerate(writers):
            batches = 0
            while True:
                out = w.recv()
                if "done" in out:
                    break
                acked.update(out["ack"])
                batches += 1
                if i == victim and batches == kill_after:
                    w.kill()
                    break
        while "done" not in (out := reader.recv()):
            assert out["wrong"] == []
        assert out["wrong"] == 0
        replacement = procs(1)[0]
        opened(replacement, tmp_path, **big)
        writers[victim] = replacement  # a restart: it adopts the killed one's directory
    (check,) = procs(1)
    opened(check, tmp_path, role="reader", **big)
    seen = check.call("get", keys=sorted(acked))
    assert seen["wrong"] == [] and seen["misses"] == []  # every acknowledged page is served


def test_slot_reuse_under_a_reader_is_a_miss_never_wrong_bytes(tmp_path, procs):
    owner, reader = procs(2)
    opened(owner, tmp_path, capacity_pages=8)
    assert owner.call("put", keys=list(range(8)))["ok"] == [True] * 8
    opened(reader, tmp_path, role="reader", follow_interval_s=600.0)  # its view goes stale
    assert reader.call("get", keys=list(range(8)))["hits"] == list(range(8))
    assert owner.call("put", keys=list(range(8, 16)))["ok"] == [True] * 8  # reuses every slot
    seen = reader.call("get", keys=list(range(8)))  # stale mappings: the slots hold other pages now
    assert seen["wrong"] == [] and seen["misses"] == list(range(8))
    counters = reader.call("stats")["counters"]
    assert counters["remote_reuse_races"] == 8 and counters["corrupt_pages"] == 0
    # And racing for real: the owner keeps reusing 8 slots while the reader reads.
    owner.send("churn", keys=list(range(100, 300)))
    reader.send("read_loop", keys=list(range(100, 300)), rounds=4)
    while "done" not in owner.recv():
        pass
    while "done" not in (out := reader.recv()):
        assert out["wrong"] == []
    assert out["wrong"] == 0 and out["misses"] > 0


def test_a_peer_directory_that_vanishes_is_misses(tmp_path, procs):
    a, b = procs(2)
    wid_a = opened(a, tmp_path)["wid"]
    opened(b, tmp_path)
    assert a.call("put", keys=list(range(16)))["ok"] == [True] * 16
    assert b.call("get", keys=list(range(16)))["hits"] == list(range(16))
    a.kill()
    shutil.rmtree(tmp_path / f"ns-{namespace(PAGE).digest().hex()}" / f"w-{wid_a}")
    b.call("refresh")
    seen = b.call("get", keys=list(range(16)))
    assert seen["wrong"] == [] and seen["misses"] == list(range(16))
    assert b.call("prefix", keys=list(range(16)))["n"] == 0


# ---------------------------------------------------------------------- refusals (one process)
def test_a_format_1_store_is_refused(tmp_path):
    ns = namespace(PAGE)
    ns_dir = tmp_path / ns.dirname()
    ns_dir.mkdir()
    payload = {"format_version": 1, "namespace": ns.to_mapping(), "slot_bytes": 16384, "device_index": 0,
               "device_count": 1, "store_id": "old"}
    body = msgpack.packb(payload)  # a format-1 header, as an older build wrote it
    (ns_dir / "HEADER").write_bytes(struct.pack("<8sIQ", fmt.HEADER_MAGIC, len(body), xxhash.xxh3_64_intdigest(body))
                                    + body)
    with pytest.raises(StoreFormatError) as info:
        SharedPool.open_writer(store_config(tmp_path, page_bytes=PAGE), ns)
    text = str(info.value)
    assert str(ns_dir) in text and "format 1" in text and "this build reads format 2" in text
    assert f"rm -r {ns_dir}" in text


def test_parts_other_than_the_namespaces_are_refused(tmp_path):
    ns = namespace(PAGE)
    SharedPool.open_writer(store_config(tmp_path, page_bytes=PAGE), ns).close()
    header_path = tmp_path / ns.dirname() / "HEADER"
    header = fmt.unpack_header(fmt.HEADER_MAGIC, header_path.read_bytes(), "h")
    header["parts"] = [PAGE // 2, PAGE // 2]
    header_path.write_bytes(fmt.pack_header(fmt.HEADER_MAGIC, header))
    with pytest.raises(StoreFormatError, match=r"parts is \[6144, 6144\] on disk but \[12288\] here"):
        SharedPool.open_writer(store_config(tmp_path, page_bytes=PAGE), ns)


def _write_pages(config, ns, count: int) -> str:
    mem = HostMemory(count, PAGE)
    with SharedPool.open_writer(config, ns) as pool:
        for n in range(count):
            mem.fill(n, n)
        assert pool.put([key(n) for n in range(count)], [mem.runs(n) for n in range(count)]) == [True] * count
        assert pool.wid is not None
        return pool.wid


@pytest.mark.parametrize("separate_meta", [False, True])
def test_meta_gone_is_refused_naming_fsck_rebuild(tmp_path, separate_meta):
    ns = namespace(PAGE)
    dev, meta = tmp_path / "dev", tmp_path / "meta"
    dev.mkdir()
    meta.mkdir()
    config = store_config(dev, page_bytes=PAGE, **({"meta_dir": str(meta)} if separate_meta else {}))
    wid = _write_pages(config, ns, 8)
    wdir = (meta if separate_meta else dev) / ns.dirname() / f"w-{wid}"
    if separate_meta:
        shutil.rmtree(wdir)  # the whole meta directory of the writer is gone
    else:
        for p in [*wdir.glob("journal-*.log"), wdir / "checkpoint.bin"]:
            p.unlink()
    with pytest.raises(StoreFormatError, match=r"sgl-kvtier fsck --rebuild "):
        SharedPool.open_writer(config, ns)


def test_meta_gone_on_a_raw_device_is_refused_naming_fsck_rebuild_and_rebuilt(tmp_path):
    """A raw device keeps its journal in ``meta_dir``: with that gone, the writer's region still holds
    pages, so the open is refused; ``fsck --rebuild`` indexes them again and every page reads back exact.
    A region claimed by a writer that stored nothing is not refused."""
    from sgl_kvtier.admin.fsck import find_shards, rebuild_shard

    ns = namespace(PAGE)
    disk = tmp_path / "disk.img"
    with open(disk, "wb") as f:
        f.truncate(8 << 20)
    meta = tmp_path / "meta"
    meta.mkdir()
    config = store_config(disk, page_bytes=PAGE, meta_dir=str(meta), capacity_pages=16)
    wid = _write_pages(config, ns, 8)
    shutil.rmtree(meta / ns.dirname() / f"w-{wid}")
    with pytest.raises(StoreFormatError, match=r"region of writer .*sgl-kvtier fsck --rebuild "):
        SharedPool.open_writer(config, ns)
    (meta / ns.dirname() / f"w-{wid}").mkdir(exist_ok=True)  # what the refused open left: an empty directory
    for shard in find_shards(meta):
        rebuild_shard(shard)
    mem = HostMemory(8, PAGE)
    with SharedPool.open_writer(config, ns) as pool:
        assert pool.get([key(n) for n in range(8)], [mem.runs(n) for n in range(8)]) == [True] * 8
    expected = HostMemory(8, PAGE)
    assert [mem.page(n).tobytes() for n in range(8)] == [expected.fill(n, n) for n in range(8)]
    empty = namespace(PAGE, model="claimed-but-empty")
    with SharedPool.open_writer(config, empty) as pool:
        empty_wid = pool.wid
    shutil.rmtree(meta / empty.dirname() / f"w-{empty_wid}")
    SharedPool.open_writer(config, empty).close()  # its region holds no page: nothing to lose, opens


def test_a_reader_pool_waits_for_a_first_writer(tmp_path):
    with pytest.raises(DeviceError, match="no store here"):
        SharedPool.open_reader(store_config(tmp_path, page_bytes=PAGE), namespace(PAGE))


def test_touch_records_keep_the_key_on_replay_and_reach_the_owner(tmp_path):
    ns = namespace(PAGE)
    config = store_config(tmp_path, page_bytes=PAGE)
    mem = HostMemory(2, PAGE)
    mem.fill(0, 1)
    with SharedPool.open_writer(config, ns) as a, SharedPool.open_writer(config, ns) as b:
        assert a.put([key(1)], [mem.runs(0)]) == [True]
        b.refresh(force=True)
        assert b.get([key(1)], [mem.runs(1)]) == [True]  # a remote hit: b journals a TOUCH
        assert b.own is not None and a.own is not None
        b.own._journal.append([jw.touch_record(99, key(1))])  # and one more, as an older b would have
        a.refresh(force=True)
        peer = a.peers()[b.wid or ""]
        assert peer.recovery.touched == []  # drained by the owner on refresh
        recovered = jr.recover(b.own.layout.meta)
        assert recovered.touched == [key(1), key(1)] and recovered.slot_of == {}  # a TOUCH deletes nothing
        a_meta = a.own.layout.meta
        a.own._journal.append([jw.touch_record(100, key(1))])  # a TOUCH in its own journal, of its own key
        a.own._journal.sync()
    assert key(1) in jr.recover(a_meta).slot_of
