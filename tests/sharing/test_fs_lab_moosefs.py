"""``sharing = "cluster"`` on a second shared filesystem of another design: MooseFS (a metadata master, a
chunk server holding the data, a FUSE client per host), mounted by two lab hosts (``fs_lab`` with
``fs_lab_fs("moosefs")``). The JuiceFS module's cross-host cases run here unchanged (byte-exact serving
across hosts, a long-lived writer serving what the other host churned through its slots, a stopped writer
retired and re-registering); ``check-shared --peer-wait`` reports what MooseFS does differently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_fs_lab import (  # noqa: F401  (the JuiceFS module's cases, collected again on this module's lab)
    on_host,
    pool_dir,
    test_a_writer_open_all_along_serves_what_the_other_host_churned_through_its_slots,
    test_a_writer_stopped_past_dead_after_is_retired_by_the_other_host_and_re_registers,
    test_pages_a_writer_put_on_one_host_are_served_byte_exact_by_a_writer_on_another,
)
from test_sharing import ROOT

from sgl_kvtier.sharing.cluster_fs.detect import FsClass, classify, parse_mountinfo

pytestmark = [pytest.mark.slow, pytest.mark.fs_lab_fs("moosefs")]


def test_the_hosts_mount_moosefs_and_the_store_classes_it_shared(fs_lab):
    a, b = fs_lab.hosts
    line = next(line for line in b.mountinfo().splitlines() if f" {fs_lab.mount} " in line)
    assert " - fuse mfs\\043" in line  # "mfs#<master>", escaped by mountinfo
    mount = next(m for m in parse_mountinfo(b.mountinfo()) if m.mount_point == str(fs_lab.mount))
    assert mount.fstype == "fuse" and mount.source.startswith("mfs#") and classify(mount.fstype, mount.source) is FsClass.SHARED
    path = fs_lab.mount / "hello"
    a.run("sh", "-c", f"echo from-{a.hostname} > {path}")
    assert b.run("cat", str(path)).stdout.strip() == f"from-{a.hostname}"


def test_check_shared_on_two_moosefs_hosts(fs_lab):
    """Fit; descriptors held across the other host's overwrite see the new bytes (unlike JuiceFS)."""
    path = pool_dir(fs_lab, "check")
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_BOOT_ID"}
    env["PYTHONPATH"] = str(ROOT)
    runs = [host.popen(sys.executable, "-m", "sgl_kvtier", "check-shared", path, "--peer-wait", "40", "--json",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
            for host in fs_lab.hosts]
    try:
        outs = [run.communicate(timeout=90) for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    for (out, _), host, other in zip(outs, fs_lab.hosts, reversed(fs_lab.hosts)):
        report = json.loads(out)
        print(f"check-shared on {host.hostname} (MooseFS): {report['cross']}; notes {report['notes']}")
        assert report["fit"], report["problems"]
        assert report["fs"]["fs_class"] == "shared" and report["peer"]["host"] == other.hostname
        cross = report["cross"]
        assert cross["fresh_open_sees"] and cross["descriptor_stale_s"] is None
        assert cross["lock_scope"] in ("host-local", "cluster-wide") and cross["rename_visible_s"] is not None
    assert fs_lab.hosts[0].run("ls", "-A", path).stdout == ""  # every probe file removed
