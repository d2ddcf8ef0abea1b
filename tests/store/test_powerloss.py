"""Power loss (``sgl_kvtier.io.powerloss``): the crash-state builder itself, the fast power-cut suite over
every write path of the store (the long one is ``python -m benchmarks.powerloss``), and one regression
test per missing sync it found.

The suite records seeded workloads (``benchmarks.powerloss.workload``: first open, puts, deletes,
evictions, checkpoints, new segments, lease beats, close; one writer and two on one pool) and cuts each
at ~12 points spread over every operation class, under random cut policies. In every mode no page may
be served with wrong bytes and no open may fail; under ``batch``/``always`` no acknowledged page may be
lost. The same checks run on a shared raw pool (``benchmarks.store.powerloss_raw``: one pool file, its
writers' leases, configs, checkpoints and journal areas on it, O_DIRECT + fdatasync; one writer and two of
two host_index), whose O_DIRECT writes must all reach the recorder.
"""

from __future__ import annotations

import mmap
import os
import random
from functools import cache
from pathlib import Path

import pytest

from benchmarks.powerloss import (
    CutResult,
    check_cut,
    config,
    key,
    namespace,
    page_bytes_for,
    recording,
    run_suite,
    workload,
)
from benchmarks.store.hostpool import HostPool
from sgl_kvtier.io.powerloss import CutPolicy, Recorder, Recording, build, materialize, random_policy, stratified_cuts
from sgl_kvtier.sharing.pool import SharedPool

DROP = CutPolicy("drop", "drop")
KEEP = CutPolicy("keep", "keep")


def cut_at_end(rec: Recording, policy: CutPolicy = DROP, seed: int = 0) -> dict[str, bytes | None]:
    return build(rec, len(rec.entries), policy, random.Random(seed))


def write_file(path, data: bytes, sync: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- the builder
def test_unsynced_write_is_dropped_and_synced_write_kept(tmp_path):
    write_file(tmp_path / "a", b"old")  # before the recorder: the durable start
    with Recorder(tmp_path) as rec:
        fd = os.open(tmp_path / "a", os.O_WRONLY)
        os.pwrite(fd, b"NEW", 0)
        synced_at = len(rec.recording.entries)
        os.fsync(fd)
        os.pwrite(fd, b"!", 3)
        os.close(fd)
    r = rec.recording
    assert build(r, synced_at, DROP, random.Random(0)) == {"a": b"old"}
    assert cut_at_end(r) == {"a": b"NEW"}  # the fsync covered the first write, not the one after it
    assert cut_at_end(r, CutPolicy("keep", "drop")) == {"a": b"NEW!"}
    assert (tmp_path / "a").read_bytes() == b"NEW!"  # every call went to the real filesystem too


def test_create_without_directory_fsync_vanishes(tmp_path):
    with Recorder(tmp_path) as rec:
        write_file(tmp_path / "f", b"data", sync=True)  # the file's own fsync does not persist its entry
    assert cut_at_end(rec.recording) == {}
    assert cut_at_end(rec.recording, KEEP) == {"f": b"data"}
    (tmp_path / "f").unlink()
    with Recorder(tmp_path) as rec:
        write_file(tmp_path / "f", b"data", sync=True)
        fsync_dir(tmp_path)
    assert cut_at_end(rec.recording) == {"f": b"data"}


def test_rename_without_directory_fsync_leaves_the_old_name(tmp_path):
    write_file(tmp_path / "ckpt", b"v1")
    with Recorder(tmp_path) as rec:
        write_file(tmp_path / "ckpt.tmp", b"v2", sync=True)
        os.replace(tmp_path / "ckpt.tmp", tmp_path / "ckpt")
        before_dir_sync = len(rec.recording.entries)
        fsync_dir(tmp_path)
    assert build(rec.recording, before_dir_sync, DROP, random.Random(0)) == {"ckpt": b"v1"}
    assert cut_at_end(rec.recording) == {"ckpt": b"v2"}


def test_new_directory_lost_takes_its_synced_files(tmp_path):
    with Recorder(tmp_path) as rec:
        os.mkdir(tmp_path / "d")
        write_file(tmp_path / "d" / "f", b"x", sync=True)
        fsync_dir(tmp_path / "d")  # f's entry is durable in d, but d's own entry is not
    assert cut_at_end(rec.recording) == {}
    with Recorder(tmp_path) as rec:
        os.mkdir(tmp_path / "e")
        fsync_dir(tmp_path)
        write_file(tmp_path / "e" / "f", b"y", sync=True)
        fsync_dir(tmp_path / "e")
    assert cut_at_end(rec.recording) == {"d": None, "d/f": b"x", "e": None, "e/f": b"y"}  # d: on disk at start


@pytest.mark.parametrize("granularity", [512, 4096])
def test_torn_writes_land_in_aligned_chunks(tmp_path, granularity):
    old, new = bytes(16384), b"\xff" * 16384
    write_file(tmp_path / "a", old)
    with Recorder(tmp_path) as rec:
        fd = os.open(tmp_path / "a", os.O_WRONLY)
        os.pwrite(fd, new, 0)
        os.close(fd)
    mixes = set()
    for seed in range(8):
        got = cut_at_end(rec.recording, CutPolicy("torn", "drop", granularity), seed)["a"]
        assert got is not None and len(got) == len(old)
        chunks = [got[i:i + granularity] for i in range(0, len(got), granularity)]
        assert all(c in (old[:granularity], new[:granularity]) for c in chunks)  # whole chunks only
        mixes.add(tuple(c == new[:granularity] for c in chunks))
    assert len(mixes) > 1  # the seed decides which chunks landed


def test_reorder_lands_later_writes_without_earlier_ones(tmp_path):
    write_file(tmp_path / "a", b"....")
    with Recorder(tmp_path) as rec:
        fd = os.open(tmp_path / "a", os.O_WRONLY)
        for i in range(4):
            os.pwrite(fd, b"x", i)
        os.close(fd)
    seen = {cut_at_end(rec.recording, CutPolicy("reorder", "drop"), seed)["a"] for seed in range(16)}
    assert any(got[0:1] == b"." and b"x" in got for got in seen)  # a later write landed, the first did not


def test_odirect_writes_sit_in_a_volatile_cache_unless_the_device_protects_them(tmp_path):
    buf = mmap.mmap(-1, 4096)  # page-aligned memory for O_DIRECT
    buf.write(b"D" * 4096)
    write_file(tmp_path / "a", bytes(4096), sync=True)
    for durable, want in ((False, bytes(4096)), (True, b"D" * 4096)):
        with Recorder(tmp_path, direct_durable=durable) as rec:
            try:
                fd = os.open(tmp_path / "a", os.O_WRONLY | os.O_DIRECT)
            except OSError:
                pytest.skip("the filesystem under tmp_path refuses O_DIRECT")
            os.pwrite(fd, buf, 0)
            os.close(fd)
        assert cut_at_end(rec.recording) == {"a": want}


def test_keep_keep_rebuilds_the_directory_as_it_is(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    rec = workload(root, "batch", seed=3, steps=12)
    tree = cut_at_end(rec, KEEP)
    on_disk = {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in root.rglob("*")}
    assert tree == on_disk
    assert rec.adopted == 0  # every file the store wrote went through the wrappers
    out = materialize(tree, tmp_path / "copy")
    assert {str(p.relative_to(out)) for p in out.rglob("*")} == set(on_disk)


def test_stratified_cuts_cover_every_operation_class(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    rec = workload(root, "batch", seed=5, steps=20)
    classes = {rec.op_class(i) for i, e in enumerate(rec.entries) if e.kind != "mark"}
    for path in ("write seg-#.dat", "fdatasync seg-#.dat", "add seg-#.dat", "alloc seg-#.dat",
                 "write journal-#.log", "fsync journal-#.log", "move checkpoint.bin", "del journal-#.log",
                 "add HEADER", "write LEASE", "fdatasync LEASE", "fsync dir w-pl-#"):
        assert path in classes
    cuts = stratified_cuts(rec, len(classes) + 2, random.Random(0))
    assert {rec.op_class(c - 1) for c in cuts if c and rec.entries[c - 1].kind != "mark"} >= classes - {"mark"}


# ---------------------------------------------------------------------- the fast suite
@cache
def suite(tmp_root: str, durability: str, writers: int) -> tuple[CutResult, ...]:
    return tuple(run_suite(Path(tmp_root), durability, seed=11 + writers, cuts=12, writers=writers))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return str(tmp_path_factory.mktemp("powerloss"))


@pytest.mark.parametrize("writers", [1, 2])
@pytest.mark.parametrize("durability", ["batch", "always", "none"])
def test_power_cuts_never_serve_wrong_bytes_nor_refuse_an_open(scratch, durability, writers):
    results = suite(scratch, durability, writers)
    assert len(results) == 12
    if durability != "none":  # under none, pages are served only where unsynced data happened to land
        assert sum(r.pages_checked for r in results) > 0
    assert [r for r in results if r.wrong_bytes] == []
    assert [r for r in results if r.refused] == []


@pytest.mark.parametrize("writers", [1, 2])
@pytest.mark.parametrize("durability", ["batch", "always"])
def test_power_cuts_keep_every_acknowledged_page(scratch, durability, writers):
    results = suite(scratch, durability, writers)
    assert sum(r.acked for r in results) > 0
    assert [r for r in results if r.acked_lost] == []


# ---------------------------------------------------------------------- regressions (one per missing sync)
def put_pages(pool: SharedPool, first: int, count: int) -> list[bool]:
    mem = HostPool(56 * 1024, 1)
    oks = []
    for n in range(first, first + count):
        mem.write(0, page_bytes_for(n, 56 * 1024))
        oks += pool.put([key(n)], [mem.runs(0)])
    return oks


def lost_after_cut(rec: Recording, cut: int, tmp_path, writers: int = 1) -> CutResult:
    result = check_cut(rec, cut, DROP, random.Random(0), tmp_path, "batch", writers)
    assert result.wrong_bytes == 0 and result.refused == ""
    return result


def test_regression_a_new_namespace_directory_survives_a_power_cut(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    with recording(root) as rec, SharedPool.open_writer(config(root, "batch"), namespace()) as pool:
        assert put_pages(pool, 0, 3) == [True] * 3
        acked = rec.mark("state", list(range(3)))
    assert lost_after_cut(rec.recording, acked + 1, tmp_path).acked_lost == 0


def test_regression_a_second_writer_directory_survives_a_power_cut(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    cfg = config(root, "batch")
    with SharedPool.open_writer(cfg, namespace()) as first:  # durable before the recording starts
        with recording(root) as rec, SharedPool.open_writer(cfg, namespace()) as second:
            assert second.wid != first.wid and put_pages(second, 100, 3) == [True] * 3
            acked = rec.mark("state", [100, 101, 102])
    assert lost_after_cut(rec.recording, acked + 1, tmp_path, writers=2).acked_lost == 0


def test_regression_a_new_segment_survives_a_power_cut(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    cfg = config(root, "batch")
    with SharedPool.open_writer(cfg, namespace()) as pool:
        put_pages(pool, 0, 2)  # segment 0 exists, durably, before the recording
    with recording(root) as rec, SharedPool.open_writer(cfg, namespace()) as pool:
        assert put_pages(pool, 2, 18) == [True] * 18  # slots 17.. are in segment 1, made now
        acked = rec.mark("state", list(range(20)))
    assert any(e.kind == "add" and e.path.endswith("seg-00001.dat") for e in rec.recording.entries)
    assert lost_after_cut(rec.recording, acked + 1, tmp_path).acked_lost == 0


def test_the_builder_is_deterministic(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    rec = workload(root, "batch", seed=9, steps=10)
    rng_a, rng_b = random.Random(4), random.Random(4)
    for cut in stratified_cuts(rec, 6, random.Random(1)):
        pa, pb = random_policy(rng_a), random_policy(rng_b)
        assert pa == pb and build(rec, cut, pa, rng_a) == build(rec, cut, pb, rng_b)


def test_regression_a_writer_directory_rebuild_makes_survives_a_power_cut(tmp_path):
    """``fsck --rebuild`` of a writer whose meta directory is gone makes it (``rebuild.lock_writer``): the
    new directory's entry must be synced in its parent, or the rebuilt checkpoint vanishes with it."""
    import numpy as np

    from sgl_kvtier.admin import rebuild
    from sgl_kvtier.store import journal_write as jw

    (tmp_path / "ns").mkdir()
    meta = tmp_path / "ns" / "w-x-0"
    with Recorder(tmp_path) as rec:
        fd = rebuild.lock_writer(meta)
        empty = np.zeros(0, dtype=np.int64)
        jw.write_checkpoint(meta, [], empty, np.zeros(0, dtype=np.uint64), empty, 1, 1)
        rebuild.unlock_writer(fd)
    assert "ns/w-x-0/checkpoint.bin" in cut_at_end(rec.recording)


def test_the_long_suite_runs_and_writes_its_figures(tmp_path):
    import json

    from benchmarks.powerloss import main

    rc = main(["--cuts", "4", "--modes", "always", "--dir", str(tmp_path / "w"), "--out", str(tmp_path)])
    row = json.loads((tmp_path / "powerloss.json").read_text())["modes"]["always"]
    assert row["cuts"] == 4 and row["wrong_bytes"] == 0 and row["refused_opens"] == 0
    raw_row = json.loads((tmp_path / "powerloss.json").read_text())["raw"]["always"]
    assert raw_row["cuts"] == 4 and raw_row["wrong_bytes"] == raw_row["refused_opens"] == raw_row["acked_lost"] == 0
    assert rc == (1 if row["acked_lost"] else 0)


# ---------------------------------------------------------------------- a shared raw pool (meta on the device)
def test_raw_pool_writes_all_go_through_the_recorder_as_odirect(tmp_path):
    """Every O_DIRECT write of the pool file (``pool_dev.write_at``: ``os.pwritev`` of an mmap buffer, then
    ``os.fdatasync``) and every slot write is logged: keep/keep rebuilds the file as it is, and with a
    power-loss-protected device (``direct_durable``) even drop/drop does, so each one was an O_DIRECT write."""
    from benchmarks.store import powerloss_raw as raw

    for direct_durable, policy in ((False, KEEP), (True, DROP)):
        root = tmp_path / f"pool-{direct_durable}"
        root.mkdir()
        rec = raw.workload(root, "batch", seed=3, writers=2, steps=30,
                           recording=lambda r, d=direct_durable: recording(r, direct_durable=d))
        assert rec.adopted == 0 and cut_at_end(rec, policy) == {raw.POOL: (root / raw.POOL).read_bytes()}
    classes = set(raw.op_classes(rec, raw.area_of(root / raw.POOL)))
    for h in (0, 1):
        for area in ("LEASE", "CONFIG", "slots", "ckpt 0 head", "ckpt 1 body", *(f"journal {i} head" for i in range(4))):
            assert f"write h{h} {area}" in classes and f"fdatasync after h{h} {area}" in classes
        assert f"write host-lease {h}" in classes and f"write table {h}" in classes


@cache
def raw_suite(tmp_root: str, durability: str, writers: int) -> tuple[CutResult, ...]:
    return tuple(run_suite(Path(tmp_root), durability, seed=21 + writers, cuts=16, writers=writers, layout="raw",
                           cuts_per_run=8))


@pytest.mark.parametrize("writers", [1, 2])
@pytest.mark.parametrize("durability", ["batch", "always", "none"])
def test_raw_pool_power_cuts_serve_no_wrong_bytes_lose_no_acked_page_refuse_no_open(scratch, durability, writers):
    results = raw_suite(scratch, durability, writers)
    assert len(results) == 16 and sum(r.pages_checked for r in results) > 0
    assert [r for r in results if r.wrong_bytes or r.refused] == []
    if durability != "none":
        assert sum(r.acked for r in results) > 0 and [r for r in results if r.acked_lost] == []
