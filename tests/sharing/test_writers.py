"""Writer identity (``sharing.writers``): the lowest free ``w-<host_id>-<k>``, liveness, ``sharing = "off"``."""

from __future__ import annotations

import errno
import fcntl
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import namespace, open_store, store_config

from sgl_kvtier.errors import StoreLockedError
from sgl_kvtier.sharing import writers
from sgl_kvtier.sharing.lease import Lease, read_lease
from sgl_kvtier.sharing.writers import claim_writer, host_id, writer_alive, writer_dirs
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.layout import meta_dir


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


def test_a_fenced_directory_is_never_adopted(tmp_path):
    """A directory another host retired (a fence in it, its files being deleted) is skipped at claim: a
    restart of its host takes the next k, and the deletion finishes under nobody's feet."""
    config = store_config(tmp_path, host_id="h")
    meta = ns_meta(tmp_path)
    first = claim_writer(config, meta)
    first.release()
    (first.path / "FENCE").write_bytes(fmt.pack_fence_block({"incarnation": b"x" * 16, "by": "g-0"}))
    again = claim_writer(config, meta)
    assert again.wid == "h-1"
    again.release()
    (first.path / "FENCE").write_bytes(b"")  # an empty FENCE (every cluster writer makes one) is no fence
    assert claim_writer(config, meta).wid == "h-0"


def test_a_directory_a_retirer_removes_while_it_is_claimed_is_made_again(tmp_path, monkeypatch):
    """A retirer's last step removes an empty writer directory: if that is one a claim has just made (the
    same wid, re-registering), the claim makes it again instead of failing as an unwritable device."""
    config = store_config(tmp_path, host_id="h")
    meta = ns_meta(tmp_path)
    real_make_dir, removed = writers.make_dir, []

    def retirer_after(path: Path) -> None:
        real_make_dir(path)
        if path.name == "w-h-0" and not removed:
            os.rmdir(path)  # the retirer's rmdir, between the claim's make_dir and its LOCK
            removed.append(path)

    monkeypatch.setattr(writers, "make_dir", retirer_after)
    claim = claim_writer(config, meta)
    assert removed and claim.wid == "h-0" and (meta / "w-h-0" / "LOCK").read_text() == str(os.getpid())
    claim.release()


def test_a_writer_directory_removed_by_another_host_during_the_listing_is_skipped(tmp_path, monkeypatch):
    """On a network filesystem a directory another host removed after the listing answers ESTALE: it is not
    listed, and nothing raises (``Peers.refresh`` and the quota step list writers on every step)."""
    config = store_config(tmp_path, host_id="h")
    meta = ns_meta(tmp_path)
    claims = [claim_writer(config, meta) for _ in range(2)]
    real_is_dir = Path.is_dir

    def stale(path: Path) -> bool:
        if path.name == "w-h-0":
            raise OSError(errno.ESTALE, "Stale file handle", str(path))
        return real_is_dir(path)

    monkeypatch.setattr(Path, "is_dir", stale)
    assert [w for w, _ in writer_dirs(meta)] == ["h-1"]
    for claim in claims:
        claim.release()


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


# ---------------------------------------------------------------------------------------------- duplicate host_id
ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "sharing_worker.py"


class FakeTime:
    """A wall clock that moves only when the watch sleeps; ``on_sleep`` runs at each sleep (a beat)."""

    def __init__(self, on_sleep=None):
        self.now = time.time()
        self.slept = 0.0
        self.on_sleep = on_sleep

    def clock(self):
        return self.now

    def sleep(self, seconds):
        assert seconds > 0
        self.now += seconds
        self.slept += seconds
        if self.on_sleep is not None:
            self.on_sleep()

    def watch(self):
        return writers.ClaimWatch(clock=self.clock, sleep=self.sleep)


def other_machine_lease(tmp_path, boot="another-machine", heartbeat_s=2.0):
    """w-h-0 with the lease of a writer of another machine using host_id "h" (its LOCK free, as when flock
    does not reach across hosts): the ``Lease`` it beats."""
    config = store_config(tmp_path, host_id="h")
    claim = claim_writer(config, ns_meta(tmp_path))
    claim.release()
    identity = {"wid": claim.wid, "host_id": "h", "machine_id": "m2", "boot_id": boot, "pid": 1,
                "incarnation": os.urandom(16)}
    lease = Lease(claim.path / "LEASE", identity, lambda: {"pages": 0}, heartbeat_s)
    lease.beat()
    return config, lease


def lock_is_free(path):
    fd = os.open(path / "LOCK", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_host_id_beating_from_another_boot_is_refused_and_the_claim_released(tmp_path):
    config, lease = other_machine_lease(tmp_path)
    fake = FakeTime(on_sleep=lease.beat)  # the other machine beats while we watch
    with pytest.raises(writers.DuplicateHostError, match="two machines use host_id h: w-h-0 is beating from "
                                                         "another boot .boot_id another-machine") as err:
        claim_writer(config, ns_meta(tmp_path), watch=fake.watch())
    assert isinstance(err.value, StoreLockedError) and "give each host its own host_id" in str(err.value)
    assert 0 < fake.slept <= 2 * 2.0
    assert lock_is_free(ns_meta(tmp_path) / "w-h-0")  # the claim (of w-h-0 itself) was released
    lease.close()


def test_a_still_lease_of_another_boot_is_watched_two_beats_then_the_claim_stands(tmp_path):
    config, lease = other_machine_lease(tmp_path)
    lease.close()  # a recent lease nobody beats any more (a quick reboot of this host)
    fake = FakeTime()
    claim = claim_writer(config, ns_meta(tmp_path), watch=fake.watch())
    assert claim.wid == "h-0" and fake.slept == pytest.approx(2 * 2.0)
    claim.release()


def test_an_old_lease_of_an_earlier_boot_never_delays_a_restart(tmp_path):
    config, lease = other_machine_lease(tmp_path)
    lease.close()
    old = time.time() - 3 * 2.0 - 1
    os.utime(lease.path, (old, old))
    fake = FakeTime(on_sleep=lambda: pytest.fail("watched a lease three heartbeats old"))
    claim = claim_writer(config, ns_meta(tmp_path), watch=fake.watch())
    assert claim.wid == "h-0" and fake.slept == 0
    claim.release()


def test_leases_of_this_boot_and_of_other_hosts_are_not_watched(tmp_path):
    fake = FakeTime(on_sleep=lambda: pytest.fail("watched a lease it need not"))
    with open_store(tmp_path, host_id="h"), open_store(tmp_path, host_id="g"):  # this boot's: h-0, g-0
        other_machine_lease_dir = ns_meta(tmp_path) / "w-x-0"
        claim = claim_writer(store_config(tmp_path, host_id="x"), ns_meta(tmp_path))
        claim.release()
        identity = {"wid": "x-0", "host_id": "x", "boot_id": "elsewhere", "pid": 1, "incarnation": b"i" * 16}
        Lease(other_machine_lease_dir / "LEASE", identity, dict, 2.0).beat()
        claim = claim_writer(store_config(tmp_path, host_id="h"), ns_meta(tmp_path), watch=fake.watch())
        assert claim.wid == "h-1"
        claim.release()


def test_a_writer_process_of_another_boot_on_our_host_id_is_seen(tmp_path):
    """A real writer process standing for another machine (``KVTIER_BOOT_ID``) with host_id "h" holds w-h-0
    and beats on demand, during our watch only."""
    env = {**os.environ, "KVTIER_BOOT_ID": "machine-two", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)

    def call(op, **fields):
        proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        proc.stdin.flush()
        out = json.loads(proc.stdout.readline())
        assert "error" not in out, out
        return out

    try:
        info = call("open", path=str(tmp_path), role="writer", page_bytes=16 * 1024 - 4096, capacity_pages=64,
                    config={"host_id": "h", "heartbeat_s": 600.0, "follow_interval_s": 0.0})
        assert info["wid"] == "h-0"
        fake = FakeTime(on_sleep=lambda: call("beat"))
        config = store_config(tmp_path, 64, 16 * 1024 - 4096, host_id="h")
        with pytest.raises(writers.DuplicateHostError, match="w-h-0 is beating from another boot .boot_id machine-two"):
            claim_writer(config, meta_dir(config, namespace(16 * 1024 - 4096)), watch=fake.watch())
        assert lock_is_free(meta_dir(config, namespace(16 * 1024 - 4096)) / "w-h-1")  # ours, released
    finally:
        proc.kill()
        proc.wait()


def test_a_long_heartbeat_is_watched_ten_seconds_at_most(tmp_path):
    config, lease = other_machine_lease(tmp_path, heartbeat_s=600.0)
    lease.close()
    fake = FakeTime()
    claim_writer(config, ns_meta(tmp_path), watch=fake.watch()).release()
    assert fake.slept == pytest.approx(2 * writers.MAX_WATCHED_BEAT_S)
