"""Writer identity (``store.writers``): the lowest free ``w-<host_id>-<k>``, liveness, ``sharing = "off"``."""

from __future__ import annotations

import multiprocessing
import os
import socket

import pytest
from support import namespace, open_store, store_config

from sgl_kvtier.errors import StoreLockedError
from sgl_kvtier.store import writers
from sgl_kvtier.store.layout import meta_dir
from sgl_kvtier.store.lease import read_lease
from sgl_kvtier.store.writers import claim_writer, host_id, writer_alive, writer_dirs


def ns_meta(path):
    return meta_dir(store_config(path), namespace())


def test_host_id_is_the_configs_or_the_sanitised_hostname(tmp_path, monkeypatch):
    assert host_id(store_config(tmp_path, host_id="gpu01.rack2")) == "gpu01.rack2"
    monkeypatch.setattr(socket, "gethostname", lambda: "node-7/a b")
    assert host_id(store_config(tmp_path)) == "node_7_a_b"  # no '-': it separates k


def test_the_lowest_free_k_is_claimed_and_a_freed_one_is_adopted(tmp_path):
    config = store_config(tmp_path, host_id="h")
    meta = ns_meta(tmp_path)
    first, second, third = (claim_writer(config, meta) for _ in range(3))
    assert [c.wid for c in (first, second, third)] == ["h-0", "h-1", "h-2"]
    assert [w for w, _ in writer_dirs(meta)] == ["h-0", "h-1", "h-2"]
    assert (meta / "w-h-1" / "LOCK").read_text() == str(os.getpid())
    second.release()
    again = claim_writer(config, meta)
    assert again.wid == "h-1"  # a restart takes the free directory back
    for claim in (first, third, again):
        claim.release()
    first.release()  # idempotent


def test_sharing_off_keeps_the_one_writer_rule_naming_the_holder(tmp_path):
    with open_store(tmp_path, sharing="off", host_id="h") as store:
        assert store.wid == "h-0"
        with pytest.raises(StoreLockedError, match=f"already open for writing by pid {os.getpid()}"):
            open_store(tmp_path, sharing="off", host_id="h")
    with open_store(tmp_path, sharing="off", host_id="h") as store:
        assert store.wid == "h-0"


def test_liveness_on_this_host(tmp_path):
    config = store_config(tmp_path, host_id="h")
    meta = ns_meta(tmp_path)
    claim = claim_writer(config, meta)
    assert writer_alive(claim.path, None, "h") is True
    assert writer_alive(claim.path, {"host_id": "other"}, "h") is None  # another host: unknown here
    assert writer_alive(claim.path, {"host_id": "h", "boot_id": "an-earlier-boot"}, "h") is False
    claim.release()
    assert writer_alive(claim.path, None, "h") is False  # LOCK free: dead at once
    assert writer_alive(meta / "w-h-9", None, "h") is False  # no directory: nobody


def _claim_in_child(path: str, to_parent, to_children) -> None:
    config = store_config(path, host_id="h")
    claim = claim_writer(config, meta_dir(config, namespace()))
    to_parent.put(claim.wid)
    to_children.get()  # held until the parent has heard from every child


def test_writers_claiming_at_once_never_fail(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    to_parent, to_children = ctx.Queue(), ctx.Queue()
    children = [ctx.Process(target=_claim_in_child, args=(str(tmp_path), to_parent, to_children)) for _ in range(4)]
    for c in children:
        c.start()
    wids = sorted(to_parent.get(timeout=60) for _ in children)
    for _ in children:
        to_children.put(None)
    for c in children:
        c.kill()  # a SIGKILL frees each lock just as a close would
        c.join()
    assert wids == ["h-0", "h-1", "h-2", "h-3"]
    assert all(writer_alive(p, None, "h") is False for _, p in writer_dirs(ns_meta(tmp_path)))


def test_a_writer_stores_in_its_own_directory_and_leases_it(tmp_path):
    with open_store(tmp_path, host_id="h") as a, open_store(tmp_path, host_id="h") as b:
        assert (a.wid, b.wid) == ("h-0", "h-1")
        assert a.layout.meta == ns_meta(tmp_path) / "w-h-0" and b.layout.meta.name == "w-h-1"
        lease = read_lease(a.layout.meta / "LEASE")
        assert lease is not None and lease["wid"] == "h-0" and lease["pid"] == os.getpid()
        assert lease["incarnation"] == a.incarnation and a.incarnation != b.incarnation
        assert lease["boot_id"] == writers.boot_id() and lease["host_id"] == "h"
