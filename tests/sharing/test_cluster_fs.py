"""Filesystem detection and the check-shared probes (``sharing.cluster_fs.detect``, ``sharing.cluster_fs.probes``): mountinfo parsing and the longest
matching mount point on injected texts, the classes, and the probes on real files."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from sgl_kvtier.errors import DeviceError
from sgl_kvtier.sharing.cluster_fs import cross_host
from sgl_kvtier.sharing.cluster_fs import probes as fs_probes
from sgl_kvtier.sharing.cluster_fs.detect import FsClass, classify, detect, parse_mountinfo
from sgl_kvtier.sharing.cluster_fs.probes import check_shared, probe_direct_io


def line(mount_id, mount_point, fstype, source="src", dev="999:99", optional="shared:1"):
    """One mountinfo line (proc(5)); ``optional``: the optional fields, "" for none."""
    opt = f" {optional}" if optional else ""
    return f"{mount_id} 1 {dev} / {mount_point} rw,relatime{opt} - {fstype} {source} rw\n"


def mountinfo(*lines):
    return line(1, "/", "ext4", "/dev/vda", "999:999") + "".join(lines)  # no real device: longest prefix


@pytest.mark.parametrize("fstype, cls", [
    ("ext4", FsClass.LOCAL_ONLY), ("xfs", FsClass.LOCAL_ONLY), ("btrfs", FsClass.LOCAL_ONLY),
    ("tmpfs", FsClass.LOCAL_ONLY), ("overlay", FsClass.LOCAL_ONLY), ("zfs", FsClass.LOCAL_ONLY),
    ("f2fs", FsClass.LOCAL_ONLY), ("vfat", FsClass.LOCAL_ONLY), ("fuseblk", FsClass.LOCAL_ONLY),
    ("fuse.lxcfs", FsClass.LOCAL_ONLY),
    ("nfs", FsClass.SHARED), ("nfs4", FsClass.SHARED), ("lustre", FsClass.SHARED), ("gpfs", FsClass.SHARED),
    ("ceph", FsClass.SHARED), ("beegfs", FsClass.SHARED), ("wekafs", FsClass.SHARED), ("cifs", FsClass.SHARED),
    ("smb3", FsClass.SHARED), ("9p", FsClass.SHARED), ("fuse.hf3fs", FsClass.SHARED),
    ("fuse.juicefs", FsClass.SHARED), ("fuse.ceph-fuse", FsClass.SHARED),
    ("fuse", FsClass.UNKNOWN), ("virtiofs", FsClass.UNKNOWN), ("", FsClass.UNKNOWN), ("somethingfs", FsClass.UNKNOWN),
])
def test_classes(fstype, cls):
    assert classify(fstype) is cls


def test_a_plain_fuse_mount_is_classed_by_its_source(tmp_path):
    assert classify("fuse", "mfs#10.0.0.1:9421") is FsClass.SHARED  # MooseFS
    assert classify("fuse", "sshfs") is classify("fuse") is FsClass.UNKNOWN
    mfs = line(40, str(tmp_path), "fuse", "mfs#master:9421")
    assert detect(tmp_path, mountinfo(mfs)).fs_class is FsClass.SHARED


def test_mountinfo_lines_with_and_without_optional_fields_and_escapes():
    text = (line(1, "/", "ext4", "/dev/vda", "254:0", optional="")
            + line(2, "/mnt/my\\040pool", "nfs4", "array:/kv", optional="shared:3 master:1 propagate_from:2")
            + "garbage line\n")
    mounts = parse_mountinfo(text)
    assert [(m.mount_point, m.fstype, m.source, m.dev) for m in mounts] == [
        ("/", "ext4", "/dev/vda", "254:0"), ("/mnt/my pool", "nfs4", "array:/kv", "999:99")]


def test_the_longest_matching_mount_point_names_the_filesystem(tmp_path):
    (tmp_path / "lus" / "x").mkdir(parents=True)
    (tmp_path / "nfsdir").mkdir()
    (tmp_path / "lusdir").mkdir()  # a string prefix of .../lus is not a path under it
    text = mountinfo(line(2, tmp_path, "nfs4", "array:/kv"), line(3, tmp_path / "lus", "lustre", "mgs@tcp:/fs"),
                     line(4, f"{tmp_path}/lusd", "fuse.hf3fs"))
    info = detect(tmp_path / "nfsdir", text)
    assert (info.fstype, info.fs_class, info.mount_point, info.source) == ("nfs4", FsClass.SHARED, str(tmp_path),
                                                                           "array:/kv")
    assert detect(tmp_path / "lus" / "x", text).fstype == "lustre"
    assert detect(tmp_path / "lus", text).fstype == "lustre"
    assert detect(tmp_path / "lusdir", text).fstype == "nfs4"
    assert detect(tmp_path, mountinfo()).fs_class is FsClass.LOCAL_ONLY  # only / matches: ext4
    # Mounted twice at one point: the later line is on top.
    assert detect(tmp_path, mountinfo(line(2, tmp_path, "nfs4"), line(3, tmp_path, "xfs"))).fstype == "xfs"


def test_the_mount_of_the_paths_own_device_wins_over_a_hidden_deeper_one(tmp_path):
    (tmp_path / "sub").mkdir()
    st = os.stat(tmp_path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    # A mount at .../sub that an over-mount of its parent hides: the path is on the parent's device.
    text = mountinfo(line(2, tmp_path, "nfs4", dev=dev), line(3, tmp_path / "sub", "ext4", dev="999:4242"))
    assert detect(tmp_path / "sub", text).fstype == "nfs4"


def test_a_symlink_is_resolved_and_no_mountinfo_is_unknown(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert detect(tmp_path / "link", mountinfo(line(2, tmp_path / "real", "nfs4"))).fstype == "nfs4"
    info = detect(tmp_path, "")
    assert info.fs_class is FsClass.UNKNOWN and info.fstype == ""
    with pytest.raises(FileNotFoundError):
        detect(tmp_path / "missing", "")


def test_this_machines_own_mountinfo(tmp_path):
    info = detect(tmp_path)
    assert info.fstype and info.fs_class is classify(info.fstype, info.source) and not info.read_only
    assert str(tmp_path.resolve()).startswith(info.mount_point)


def test_the_o_direct_probe(tmp_path, ramfs):
    if probe_direct_io(tmp_path) is not None:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    assert "refuses to open a file with O_DIRECT" in probe_direct_io(ramfs)
    assert list(tmp_path.iterdir()) == [ramfs] and list(ramfs.iterdir()) == []  # the probe files are gone


def test_check_shared_on_a_shared_filesystem_is_fit(tmp_path):
    report = check_shared(tmp_path, mountinfo=mountinfo(line(2, tmp_path, "nfs4", "array:/kv")))
    if not report.probes[0].ok:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    assert report.fit and report.problems == () and all(p.ok for p in report.probes)
    assert [p.name for p in report.probes] == ["O_DIRECT", "create-once (O_EXCL + hard link)", "rename over a file",
                                               "fsync (file and directory)"]
    out = report.to_dict()
    assert out["fit"] is True and out["fs"]["fs_class"] == "shared" and json.dumps(out)
    assert list(tmp_path.iterdir()) == []  # every probe file is removed


def test_check_shared_on_a_local_or_unknown_filesystem(tmp_path):
    local = check_shared(tmp_path, mountinfo=mountinfo())
    assert not local.fit and "ext4 at" in local.problems[0] and "only one host may mount" in local.problems[0]
    unknown = check_shared(tmp_path, mountinfo=mountinfo(line(2, tmp_path, "fuse")))
    assert unknown.fit == all(p.ok for p in unknown.probes) and "not known to be shared" in unknown.notes[0]
    with pytest.raises(DeviceError, match="not a directory"):
        check_shared(tmp_path / "missing")


def test_check_shared_names_a_filesystem_without_o_direct(ramfs):
    report = check_shared(ramfs, mountinfo=mountinfo(line(2, ramfs, "nfs4")))
    assert not report.fit and report.problems == ("O_DIRECT: the filesystem refuses to open a file with O_DIRECT",)
    assert report.probes[1].ok and report.probes[2].ok and report.probes[3].ok


def test_check_shared_names_a_failed_hard_link(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    report = check_shared(tmp_path, mountinfo=mountinfo(line(2, tmp_path, "nfs4")))
    assert "create-once (O_EXCL + hard link): Operation not permitted (errno 1)" in report.problems
    assert list(tmp_path.iterdir()) == []


class Ticks:
    """A clock that moves only by the wait's sleeps; ``on_sleep`` runs at each (what the peer does meanwhile)."""

    def __init__(self, on_sleep=None):
        self.now = 0.0
        self.sleeps = []
        self.on_sleep = on_sleep

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(len(self.sleeps))


def peer_probe(directory: Path, boot: str, age_s: float = 0.0) -> Path:
    path = directory / f"{cross_host.PEER_PREFIX}{boot}.json"
    path.write_text(json.dumps({"host": "gpu02", "boot_id": boot, "machine_id": "m2", "pid": 7, "seen": []}))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_stale_probes_and_probes_of_this_host_are_no_peer(tmp_path):
    """A peer is another boot or machine whose probe is no older than the check: never this very host,
    never a probe a check long gone left behind."""
    me = {"host": "gpu02", "boot_id": "this-boot", "machine_id": "m2", "pid": 8}
    mine = tmp_path / f"{cross_host.PEER_PREFIX}mine.json"
    mine.write_text(json.dumps({**me, "seen": []}))
    peer_probe(tmp_path, "long-gone", age_s=3600)
    peer_probe(tmp_path, "this-boot")  # this very host (same boot and machine id)
    since = time.time() - 60
    assert cross_host.find_peer(tmp_path, mine, me, since) is None
    theirs = peer_probe(tmp_path, "other-boot")
    assert cross_host.find_peer(tmp_path, mine, me, since) == (
        theirs, {"host": "gpu02", "boot_id": "other-boot", "machine_id": "m2", "pid": 7})



def test_two_checks_at_once_exchange_files_and_report_what_each_saw(tmp_path, monkeypatch):
    """Two exchanges in one directory, standing for two hosts (their own boot ids): each finds the other and
    measures its files. On one kernel a descriptor sees the overwrite at once, a rename shows at once and a
    flock held by the other blocks (flock locks open files, not processes)."""
    from concurrent.futures import ThreadPoolExecutor

    from sgl_kvtier.sharing.cluster_fs.cross_host import CrossHost, LockScope, exchange

    def host(name: str) -> dict:
        return {"host": name, "boot_id": f"boot-{name}", "machine_id": f"m-{name}", "pid": 1}

    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(exchange, tmp_path, 20.0, host(name)) for name in ("gpu01", "gpu02")]
        (peer1, seen1), (peer2, seen2) = (run.result(timeout=60) for run in runs)
    assert peer1 == host("gpu02") and peer2 == host("gpu01")
    expected = CrossHost(LockScope.CLUSTER_WIDE, None, True, False, 0.0)
    assert seen1 == expected and seen2 == expected
    assert list(tmp_path.iterdir()) == []  # every probe and file removed
    lines = {p.name: p for p in fs_probes.cross_probes(expected)}
    assert all(p.ok for p in lines.values()) and fs_probes.cross_notes(expected) == []
    stale = CrossHost(LockScope.HOST_LOCAL, fs_probes.CATCH_UP_S, False, True, 1.2)
    lines = {p.name: p for p in fs_probes.cross_probes(stale)}
    assert [p.name for p in lines.values() if not p.ok] == ["a fresh open after another host's overwrite in place"]
    assert lines["a descriptor held across another host's overwrite in place"].detail == \
        "keeps returning the old bytes (over 3 s)"
    assert lines["a rename over a name on another host"].detail == "ENOENT, then the new file after 1.2 s"
    assert len(fs_probes.cross_notes(stale)) == 2


def test_a_check_with_no_other_host_reports_none_and_leaves_nothing(tmp_path):
    from sgl_kvtier.sharing.cluster_fs.cross_host import exchange

    ticks = Ticks()
    assert exchange(tmp_path, 1.0, {"host": "a", "boot_id": "b", "machine_id": "m", "pid": 1},
                    sleep=ticks.sleep, clock=ticks.clock) == (None, None)
    assert list(tmp_path.iterdir()) == []
