"""``sharing = "cluster"`` on a second shared filesystem of another design: MooseFS (a metadata master, a
chunk server holding the data, a FUSE client per host), mounted by two lab hosts (``fs_lab`` with
``fs_lab_fs("moosefs")``). The JuiceFS module's cross-host cases run here unchanged (byte-exact serving
across hosts, a long-lived writer serving what the other host churned through its slots, a stopped writer
retired and re-registering); ``check-shared --peer-wait`` reports what MooseFS does differently.
"""

from __future__ import annotations

import pytest
from test_fs_lab import (  # noqa: F401  (the JuiceFS module's cases, collected again on this module's lab)
    check_shared_everywhere,
    on_host,
    test_a_writer_open_all_along_serves_what_the_other_host_churned_through_its_slots,
    test_a_writer_stopped_past_dead_after_is_retired_by_the_other_host_and_re_registers,
    test_pages_a_writer_put_on_one_host_are_served_byte_exact_by_a_writer_on_another,
)

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
    for report in check_shared_everywhere(fs_lab):
        assert report["fs"]["fs_class"] == "shared"
        cross = report["cross"]
        assert cross["fresh_open_sees"] and cross["descriptor_stale_s"] is None
        assert cross["lock_scope"] in ("host-local", "cluster-wide") and cross["rename_visible_s"] is not None
