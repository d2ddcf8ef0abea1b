"""What ``sharing = "cluster"`` requires of the storage, enforced by ``PageStore.open`` before any file is
made (``sharing.cluster_fs.check``): local-only filesystems refused unless ``allow_local_fs``, unknown ones warned about,
raw block devices refused, O_DIRECT or no open; journals synced per batch under ``durability = "none"``.
Real files in tmp dirs; the filesystem types come from an injected mountinfo where the test needs one."""

from __future__ import annotations

import logging
import os

import pytest
from support import HostMemory, key, namespace, open_store, store_config

from sgl_kvtier.errors import ConfigError, DeviceError
from sgl_kvtier.sharing.cluster_fs import check as fs_check
from sgl_kvtier.sharing.cluster_fs import detect as fs_detect
from sgl_kvtier.sharing.cluster_fs.check import check_cluster_open
from sgl_kvtier.sharing.cluster_fs.detect import FsClass, detect
from sgl_kvtier.store import devices
from sgl_kvtier.store import journal_write as jw
from sgl_kvtier.store.layout import direct_mode


def fake_mounts(monkeypatch, tmp_path, *mounts):
    """Make ``/proc/self/mountinfo`` read as: / on ext4, then each (path, fstype) of ``mounts``."""
    lines = ["1 0 999:999 / / rw - ext4 /dev/vda rw"]
    lines += [f"{i} 1 999:{i} / {path} rw shared:{i} - {fstype} server:/x rw" for i, (path, fstype) in
              enumerate(mounts, 2)]
    info = tmp_path / "mountinfo"
    info.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(fs_detect, "MOUNTINFO", str(info))


def device(tmp_path, name="dev"):
    d = tmp_path / name
    d.mkdir()
    return d


def store_roundtrip(path, n=4, **config):
    mem = HostMemory(n)
    for i in range(n):
        mem.fill(i, i)
    with open_store(path, **config) as store:
        assert store.put([key(i) for i in range(n)], [mem.runs(i) for i in range(n)]) == [True] * n
    mem.clear()
    with open_store(path, **config) as store:
        assert store.get([key(i) for i in range(n)], [mem.runs(i) for i in range(n)]) == [True] * n
        return store


def test_this_machines_local_filesystem_is_refused_then_allowed(tmp_path):
    info = detect(tmp_path)
    if info.fs_class is not FsClass.LOCAL_ONLY:
        pytest.skip(f"{tmp_path} is on {info.fstype}, not a local-only filesystem")
    with pytest.raises(ConfigError, match=rf"devices\[0\]: {info.fstype} at {tmp_path} .mounted at .*: a filesystem "
                                          "only one host may mount; two hosts mounting it read-write corrupt it") as e:
        open_store(tmp_path, sharing="cluster")
    assert e.value.field == "devices[0]" and "allow_local_fs = true only to try cluster mode" in str(e.value)
    assert list(tmp_path.iterdir()) == []  # refused before anything was made
    store = store_roundtrip(tmp_path, sharing="cluster", allow_local_fs=True)
    if store.layout.direct:
        assert all(a._direct_mode == devices.DIRECT_CLUSTER for a in store.layout.arenas)
    assert [p.name for p in tmp_path.iterdir()] == [namespace().dirname()]  # no probe file left


def test_a_shared_filesystem_opens_and_the_meta_dir_is_checked_too(tmp_path, monkeypatch):
    dev, meta = device(tmp_path), device(tmp_path, "meta")
    fake_mounts(monkeypatch, tmp_path, (dev, "nfs4"))
    with pytest.raises(ConfigError, match=rf"meta_dir: ext4 at {meta} .mounted at /.: a filesystem only one host"):
        open_store(dev, sharing="cluster", meta_dir=str(meta))
    assert list(dev.iterdir()) == [] and list(meta.iterdir()) == []
    fake_mounts(monkeypatch, tmp_path, (dev, "nfs4"), (meta, "fuse.hf3fs"))
    store_roundtrip(dev, sharing="cluster", meta_dir=str(meta))
    assert [i.fstype for i in check_cluster_open(store_config(dev, sharing="cluster", meta_dir=str(meta)))] == [
        "nfs4", "fuse.hf3fs"]


def test_every_device_is_checked(tmp_path, monkeypatch):
    a, b = device(tmp_path, "a"), device(tmp_path, "b")
    fake_mounts(monkeypatch, tmp_path, (a, "lustre"), (b, "xfs"))
    with pytest.raises(ConfigError, match=r"devices\[1\]: xfs at .*/b .mounted at .*/b."):
        open_store(a, sharing="cluster", devices=[a, b])


def test_an_unknown_filesystem_warns_once_and_opens(tmp_path, monkeypatch, caplog):
    dev = device(tmp_path)
    fake_mounts(monkeypatch, tmp_path, (dev, "virtiofs"))
    monkeypatch.setattr(fs_check, "_warned_unknown", set())
    with caplog.at_level(logging.WARNING, logger=fs_check.__name__):
        store_roundtrip(dev, sharing="cluster")
    warnings = [r.message for r in caplog.records if r.name == fs_check.__name__]
    assert len(warnings) == 1 and "virtiofs at" in warnings[0] and "not known to be a shared filesystem" in warnings[0]


def test_a_raw_block_device_not_pool_formatted_is_refused(tmp_path):
    """Cluster mode on a raw device needs a shared raw pool (``sgl-kvtier pool-format``; the rest of its rules:
    ``test_shared_raw.py``): a blank one is refused naming the command, and nothing is made anywhere."""
    raw = tmp_path / "raw.img"
    raw.write_bytes(b"\0" * (8 << 20))
    meta = device(tmp_path, "meta")
    with pytest.raises(ConfigError, match=r"devices\[0\]: .*raw.img is not a shared raw pool: run `sgl-kvtier "
                                          r"pool-format .*raw.img --hosts H` once"):
        open_store(raw, sharing="cluster", allow_local_fs=True, meta_dir=str(meta))
    assert list(meta.iterdir()) == [] and raw.read_bytes().count(0) == 8 << 20


def test_no_o_direct_no_cluster_open(ramfs):
    with pytest.raises(ConfigError, match=r'direct_io: .*ramfs: the filesystem refuses to open a file with O_DIRECT; '
                                          r'sharing = "cluster" needs O_DIRECT .*"auto" means "on" there') as e:
        open_store(ramfs, sharing="cluster", allow_local_fs=True)
    assert e.value.field == "direct_io" and list(ramfs.iterdir()) == []
    with open_store(ramfs) as store:  # host mode: buffered IO, as before
        assert store.layout.direct is False


def test_a_data_file_without_o_direct_fails_in_cluster_mode(ramfs):
    path = ramfs / "seg"
    path.write_bytes(b"x")
    with pytest.raises(DeviceError, match='O_DIRECT is not supported here, and sharing = "cluster" needs it'):
        devices.open_file(str(path), os.O_RDONLY, devices.DIRECT_CLUSTER)
    fd, direct = devices.open_file(str(path), os.O_RDONLY, "auto")
    os.close(fd)
    assert direct is False


def test_auto_means_on_in_cluster_mode_only(tmp_path):
    assert direct_mode(store_config(tmp_path)) == "auto"
    assert direct_mode(store_config(tmp_path, direct_io="off")) == "off"
    assert direct_mode(store_config(tmp_path, sharing="cluster")) == devices.DIRECT_CLUSTER
    assert direct_mode(store_config(tmp_path, sharing="cluster", direct_io="on")) == "on"


def test_host_mode_checks_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(fs_check, "probe_direct_io", lambda d: pytest.fail("probed in host mode"))
    assert check_cluster_open(store_config(tmp_path)) == []
    store_roundtrip(tmp_path)


@pytest.mark.parametrize("sharing, syncs", [("cluster", True), ("host", False)])
def test_journals_are_synced_per_batch_in_cluster_mode_even_without_durability(tmp_path, monkeypatch, sharing,
                                                                              syncs):
    dev = device(tmp_path)
    fake_mounts(monkeypatch, tmp_path, (dev, "nfs4"))
    calls = []
    real_sync = jw.Journal.sync
    monkeypatch.setattr(jw.Journal, "sync", lambda self: (calls.append(self), real_sync(self))[1])
    mem = HostMemory(2)
    with open_store(dev, sharing=sharing, durability="none") as store:
        calls.clear()
        assert store.put([key(0), key(1)], [mem.runs(0), mem.runs(1)]) == [True, True]
        assert len(calls) == (1 if syncs else 0)
        assert store.delete([key(0)]) == 1
        assert len(calls) == (2 if syncs else 0)
