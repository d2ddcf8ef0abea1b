"""A shared raw pool: one raw namespace (a regular file standing in for it) attached to several hosts.

Formatted once (``pool_dev.format_pool``, ``sgl-kvtier pool-format``) for two host slots; two "hosts" are two
configs with ``host_index`` 0 and 1 (and their own ``host_id`` and ``KVTIER_BOOT_ID``), no ``meta_dir``: every
journal, checkpoint, lease and config lives on the device. Lease threads stay idle (``heartbeat_s`` = 600): a
test beats a writer itself and refreshes a pool with ``force``; the host-slot watch gets an injected clock and
sleep. Every page read is checked byte for byte. No sleeps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sharing_worker import page
from support import HostMemory, key, namespace, store_config
from test_liveness import DEAD_S, RECLAIM_S, Clock
from test_sharing import Proc

from sgl_kvtier.errors import ConfigError, DeviceError
from sgl_kvtier.media.shared_raw.superblock import format_pool, superblock_of
from sgl_kvtier.sharing import shared_raw_claim as pool_claim
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.sharing.sites import open_writer

PAGE = 8192
NS = namespace(PAGE)
BOOT = "KVTIER_BOOT_ID"


def pool_file(tmp_path: Path, hosts: int = 2, size: int = 64 << 20, name: str = "pool.img") -> str:
    dev = tmp_path / name
    with open(dev, "wb") as f:
        f.truncate(size)
    format_pool([str(dev)], hosts)
    return str(dev)


def raw_config(dev: str, h: int, host: str, capacity_pages: int | None = 48, **extra):
    extra.setdefault("checkpoint_interval", 64)
    cfg = store_config(dev, capacity_pages or 1, PAGE, sharing="cluster", host_index=h, host_id=host,
                       heartbeat_s=600.0, follow_interval_s=0.0, dead_after_s=DEAD_S, reclaim_after_s=RECLAIM_S,
                       **extra)
    return cfg if capacity_pages else type(cfg).from_mapping({**cfg.to_mapping(), "capacity_bytes": None})


def put(pool, numbers: list[int]) -> list[bool]:
    mem = HostMemory(1, PAGE)
    out: list[bool] = []
    for n in numbers:
        mem.page(0)[:] = np.frombuffer(page(n, PAGE), dtype=np.uint8)
        out += pool.put([key(n)], [mem.runs(0)])
    return out


def read(pool, numbers: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(hits, misses, wrong) over ``numbers``, each page checked against its bytes."""
    mem = HostMemory(1, PAGE)
    hits, misses, wrong = [], [], []
    for n in numbers:
        mem.clear()
        ok = pool.get([key(n)], [mem.runs(0)]) == [True]
        (misses if not ok else hits if mem.page(0).tobytes() == page(n, PAGE) else wrong).append(n)
    return hits, misses, wrong


class Watch:
    """An injected clock and sleep for the host-slot watch; ``on_sleep`` runs at each sleep."""

    def __init__(self, on_sleep=None):
        self.t, self.on_sleep, self.sleeps = 0.0, on_sleep, 0

    def host_watch(self) -> pool_claim.HostWatch:
        return pool_claim.HostWatch(lambda: self.t, self._sleep)

    def _sleep(self, s: float) -> None:
        self.t += s
        self.sleeps += 1
        if self.on_sleep is not None:
            self.on_sleep()


# ------------------------------------------------------------------------------------------- format
def test_pool_format_writes_a_superblock_and_never_formats_over_anything(tmp_path):
    dev = tmp_path / "ns.img"
    dev.write_bytes(bytes(32 << 20))
    plan = format_pool([str(dev)], 4, write=False)
    assert superblock_of(str(dev)) is None and dev.read_bytes().count(0) == 32 << 20  # a plan writes nothing
    sb = format_pool([str(dev)], 4)[0]
    assert superblock_of(str(dev)) == sb and sb.hosts == 4 and plan[0].share_bytes == sb.share_bytes
    assert [sb.share(h)[0] for h in range(4)] == [sb.data_at + h * sb.share_bytes for h in range(4)]
    assert sb.share(3)[1] <= sb.device_bytes and sb.data_at >= sb.host_slots_at + 4 * sb.host_slot_bytes
    with pytest.raises(DeviceError, match=r"is a shared raw pool already; refusing to format it.*dd if=/dev/zero"):
        format_pool([str(dev)], 2)
    for at, what in ((4096, "holds data"), ((32 << 20) - 100, "holds data")):  # first MiB, last MiB
        other = tmp_path / f"used-{at}.img"
        other.write_bytes(bytes(32 << 20))
        with open(other, "r+b") as f:
            f.seek(at)
            f.write(b"XFSB")
        with pytest.raises(DeviceError, match=rf"{what} .not all zeros.; refusing to format it. If it is free, zero it"):
            format_pool([str(other)], 2)
        assert superblock_of(str(other)) is None
    with pytest.raises(DeviceError, match="too small for 2 hosts"):
        format_pool([pool_file_bytes(tmp_path, 3 << 20)], 2)


def pool_file_bytes(tmp_path: Path, size: int) -> str:
    dev = tmp_path / f"blank-{size}.img"
    dev.write_bytes(bytes(size))
    return str(dev)


def test_a_single_host_region_table_device_is_never_formatted_nor_shared(tmp_path):
    dev = pool_file_bytes(tmp_path, 8 << 20)
    meta = tmp_path / "meta"
    meta.mkdir()
    with open_writer(store_config(dev, 8, PAGE, meta_dir=str(meta)), NS):
        pass  # a region table claimed under sharing = "host"
    with pytest.raises(DeviceError, match="holds a single-host sgl-kvtier region table"):
        format_pool([dev], 2)
    with pytest.raises(ConfigError, match=r"devices\[0\]: .* holds a single-host region table"):
        open_writer(raw_config(dev, 0, "ha"), NS)


# ------------------------------------------------------------------------------------------ refusals
def test_unsafe_configurations_are_refused_naming_the_field(tmp_path):
    dev = pool_file(tmp_path)
    blank = pool_file_bytes(tmp_path, 8 << 20)
    with pytest.raises(ConfigError, match=r"devices\[0\]: .*blank.* is not a shared raw pool: run `sgl-kvtier pool-format"):
        open_writer(raw_config(blank, 0, "ha"), NS)
    with pytest.raises(ConfigError, match=r"host_index: .* is a shared raw pool of 2 hosts: set host_index .* 0\.\.1"):
        open_writer(raw_config(dev, 2, "ha"), NS)
    with pytest.raises(ConfigError, match=r"host_index: .*is a shared raw pool of 2 hosts.*\(got None\)"):
        open_writer(store_config(dev, 8, PAGE, sharing="cluster", heartbeat_s=600.0, dead_after_s=DEAD_S,
                                    reclaim_after_s=RECLAIM_S), NS)
    with pytest.raises(ConfigError, match=r"host_index: .*is a shared raw pool .*needs sharing = \"cluster\""):
        open_writer(store_config(dev, 8, PAGE), NS)  # sharing = "host", no meta_dir
    meta = tmp_path / "meta"
    meta.mkdir()
    with pytest.raises(ConfigError, match=r"host_index: .*is a shared raw pool .*needs sharing = \"cluster\""):
        open_writer(store_config(dev, 8, PAGE, meta_dir=str(meta)), NS)
    with pytest.raises(ConfigError, match=r"meta_dir: not needed with a shared raw pool"):
        open_writer(raw_config(dev, 0, "ha", meta_dir=str(meta)), NS)
    with pytest.raises(ConfigError, match=r"host_index: .*only for a shared raw pool"):
        open_writer(raw_config(str(meta), 0, "ha", allow_local_fs=True), NS)
    with pytest.raises(ConfigError, match=r"host_index: .*with sharing = \"cluster\" only"):
        store_config(dev, 8, PAGE, host_index=0)
    with pytest.raises(ConfigError, match=r"direct_io: must be \"on\" or \"auto\""):
        raw_config(dev, 0, "ha", direct_io="off")
    assert list(meta.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["blank-8388608.img", "meta",
                                                                                        "pool.img"]


# ----------------------------------------------------------------------------------------- two hosts
def test_two_hosts_serve_each_others_pages_from_their_own_shares(tmp_path, monkeypatch):
    dev = pool_file(tmp_path)
    sb = superblock_of(dev)
    assert sb is not None
    monkeypatch.setenv(BOOT, "boot-a")
    with SharedPool.open_writer(raw_config(dev, 0, "ha"), NS) as a:
        assert put(a, list(range(20))) == [True] * 20
        a.own.lease.beat()  # announces its synced journal
        monkeypatch.setenv(BOOT, "boot-b")
        with SharedPool.open_writer(raw_config(dev, 1, "hb"), NS) as b:
            assert sorted(b.peers()) == [a.wid] and read(b, list(range(20))) == (list(range(20)), [], [])
            assert put(b, list(range(100, 120))) == [True] * 20 and put(b, [3]) == [True]  # a holds 3: kept once
            b.own.lease.beat()
            assert read(a, list(range(100, 120))) == (list(range(100, 120)), [], [])  # a refreshes on the shortfall
            assert len(b.own) == 20 and a.leases()[b.wid]["host_index"] == 1
            for pool, h in ((a, 0), (b, 1)):  # each writer's region (meta and slots) lies in its host's share
                lo, hi = sb.share(h)
                region = pool.own.layout.files.region
                arena = pool.own.layout.arenas[0]
                assert lo <= region.offset < arena.offset and arena.offset + arena.capacity_slots * PAGE * 2 <= hi
            assert a.verdict(b.wid).verdict.value == "live" and not a.verdict(b.wid).same_host
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool.img"]  # no meta_dir, nothing beside the device
    monkeypatch.setenv(BOOT, "boot-a")
    with SharedPool.open_reader(raw_config(dev, 0, "ha"), NS) as r:
        assert sorted(r.peers()) == ["ha-0", "hb-0"]
        assert read(r, [*range(20), *range(100, 120)]) == ([*range(20), *range(100, 120)], [], [])


def test_a_host_keeps_only_its_own_share_in_its_quota_and_never_retires_another_host(tmp_path, monkeypatch):
    dev = pool_file(tmp_path)
    monkeypatch.setenv(BOOT, "boot-b")
    b = SharedPool.open_writer(raw_config(dev, 1, "hb", capacity_pages=16), NS)
    assert put(b, list(range(100, 112))) == [True] * 12
    b.own.lease.beat()
    b.close()  # host 1 stopped: its pages stay on the device
    monkeypatch.setenv(BOOT, "boot-a")
    clock = Clock()
    with SharedPool.open_writer(raw_config(dev, 0, "ha", capacity_pages=16), NS, clock=clock) as a:
        assert put(a, list(range(12))) == [True] * 12 and len(a.own) == 12  # another host's pages don't count
        for advance in (0.0, DEAD_S + 1, RECLAIM_S):
            clock.t += advance
            a.refresh(force=True)
            a.own.lease.beat()
            assert a.quota.last is not None and a.quota.last.retired == {} and len(a.own) == 12
            assert [u.wid for u in a.quota.last.usages] == ["ha-0"]
        assert a.verdict("hb-0").verdict.value == "dead"
        assert read(a, list(range(100, 112))) == (list(range(100, 112)), [], [])  # dead, never retired


def test_a_second_machine_with_the_same_host_index_is_refused_while_the_first_beats(tmp_path, monkeypatch):
    dev = pool_file(tmp_path)
    monkeypatch.setenv(BOOT, "boot-a")
    a = SharedPool.open_writer(raw_config(dev, 0, "ha"), NS)
    assert put(a, [1, 2]) == [True, True]
    monkeypatch.setenv(BOOT, "boot-b")
    watch = Watch(on_sleep=a.own.lease.beat)  # machine a beats while b watches
    with pytest.raises(pool_claim.HostIndexInUseError,
                       match=r"host_index 0 is in use by host ha \(boot boot-a, this one's is boot-b\)"):
        pool_claim.claim(raw_config(dev, 0, "hb"), NS, watch=watch.host_watch())
    assert watch.sleeps >= 1
    # Machine a stops beating (stopped, or dead): b watches two of its beats, then takes the slot over.
    idle = Watch()
    monkeypatch.setattr(pool_claim, "DEFAULT_WATCH", idle.host_watch())
    b = SharedPool.open_writer(raw_config(dev, 0, "hb"), NS)
    assert idle.sleeps >= 4 and b.wid == "hb-0" and put(b, [50]) == [True]
    a.own.lease.beat()  # a's next beat finds the slot taken over: it is fenced, writes nothing more
    assert a.own.fenced is not None and "host_index 0 was taken over by host hb (boot boot-b)" in a.own.fenced
    busy = Watch(on_sleep=b.own.lease.beat)
    monkeypatch.setattr(pool_claim, "DEFAULT_WATCH", busy.host_watch())
    monkeypatch.setenv(BOOT, "boot-a")
    assert put(a, [3]) == [False] and a.sharing_stats()["fenced_pages"] == 1  # re-registering is refused
    assert read(a, [1, 2]) == ([1, 2], [], [])  # its pages (now b's host slot's) stay readable
    a.close()
    b.close()


# ------------------------------------------------------------------------------------- warm restarts
def test_a_writer_restarts_warm_from_its_on_device_checkpoint_and_journal(tmp_path):
    dev = pool_file(tmp_path)
    cfg = raw_config(dev, 0, "ha", checkpoint_interval=8)
    with SharedPool.open_writer(cfg, NS) as a:
        assert put(a, list(range(30))) == [True] * 30  # several checkpoints and journal generations
        a.checkpoint()
        assert put(a, list(range(30, 40))) == [True] * 10  # after the last checkpoint: journal only
        wid, gen = a.wid, a.own._journal.generation
    with SharedPool.open_writer(cfg, NS) as a:
        assert a.wid == wid and a.own._journal.generation > gen
        assert read(a, list(range(40))) == (list(range(40)), [], [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool.img"]


@pytest.mark.parametrize("interval", [5, 1000])
def test_a_sigkilled_writer_restarts_with_every_acknowledged_page(tmp_path, interval):
    dev = pool_file(tmp_path)
    cfg = raw_config(dev, 0, "ha", checkpoint_interval=interval)
    proc = Proc()
    try:
        proc.call("open", path=dev, page_bytes=PAGE, role="writer", capacity_pages=48,
                  config={k: v for k, v in cfg.to_mapping().items() if k not in ("devices", "capacity_bytes")})
        acked = [n for n, ok in zip(range(40), proc.call("put", keys=list(range(40)))["ok"]) if ok]
    finally:
        proc.kill()
    assert len(acked) == 40
    with SharedPool.open_writer(cfg, NS) as a:
        assert a.wid == "ha-0" and read(a, acked) == (acked, [], [])


def test_a_pool_striped_over_two_devices_is_one_pool_in_that_order(tmp_path, monkeypatch):
    devs = []
    for name in ("ns1.img", "ns2.img"):
        with open(tmp_path / name, "wb") as f:
            f.truncate(32 << 20)
        devs.append(str(tmp_path / name))
    sbs = format_pool(devs, 2)
    assert [sb.device_index for sb in sbs] == [0, 1] and sbs[0].pool_id == sbs[1].pool_id
    monkeypatch.setenv(BOOT, "boot-a")
    with SharedPool.open_writer(raw_config(devs[0], 0, "ha", devices=devs), NS) as a:
        assert [x.path for x in a.own.layout.arenas] == devs and put(a, list(range(12))) == [True] * 12
        a.own.lease.beat()
        monkeypatch.setenv(BOOT, "boot-b")
        with SharedPool.open_writer(raw_config(devs[0], 1, "hb", devices=devs), NS) as b:
            assert read(b, list(range(12))) == (list(range(12)), [], [])
            for store, h in ((a.own, 0), (b.own, 1)):  # slots on both devices, each in its host's share
                for arena, sb in zip(store.layout.arenas, sbs):
                    assert sb.share(h)[0] <= arena.offset < sb.share(h)[1]
    with pytest.raises(ConfigError, match=r"devices: .*ns2.img is device 1 of 2 of pool .*, not device 0 of 2"):
        open_writer(raw_config(devs[1], 0, "ha", devices=devs[::-1]), NS)
    with pytest.raises(ConfigError, match=r"devices: .*is device 0 of 2 of pool .*not device 0 of 1"):
        open_writer(raw_config(devs[0], 0, "ha", devices=devs[:1]), NS)
