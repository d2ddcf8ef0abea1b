"""Retirement when retirers, and the writer they retire, race (``sharing.retire``): several retirers at
once, one whose fence another deleted, a retirement judged on an incarnation that no longer owns the wid
(made anew, restarted into), a writer only paused that writes on during its deletion. Helpers and the
retirement's ordinary paths are ``test_retire``'s."""

from __future__ import annotations

import os
from pathlib import Path

from support import run_concurrently
from test_liveness import cluster_config
from test_retire import NS, beat, files_of, put, read

from sgl_kvtier.sharing import retire as rt
from sgl_kvtier.sharing.lease import read_lease
from sgl_kvtier.sharing.liveness import read_fence
from sgl_kvtier.sharing.pool import SharedPool


def dead_writer(tmp_path: Path, pages: int) -> tuple[str, Path, bytes]:
    """A writer of host A that stored ``pages`` pages and is gone: its wid, namespace directory, incarnation."""
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), NS) as a:
        assert a.wid is not None and put(a, list(range(pages))) == [True] * pages
        assert a.own is not None
        return a.wid, a.ns_meta, a.own.incarnation


def test_two_retirers_at_once_are_harmless(tmp_path):
    wid, ns_meta, incarnation = dead_writer(tmp_path, 40)
    cfg = cluster_config(tmp_path, "hostb")
    done: list[rt.Deleted] = []
    run_concurrently(*[lambda: done.append(rt.retire(cfg, ns_meta, wid, incarnation, "hostb-0", "hostb"))
                       for _ in range(3)])
    assert len(done) == 3 and all(d.finished for d in done) and files_of(tmp_path, wid) == []
    assert sum(d.segment_bytes for d in done) > 0
    again = rt.delete_writer(cfg, ns_meta, wid)  # and once more, on nothing: still fine
    assert again.finished and again.files == 0


def test_a_retirer_whose_fence_another_deleted_meanwhile_stands_aside(tmp_path, monkeypatch):
    """Seen in CI: one retirer wrote its fence, and before it synced the directory another had deleted every
    file (that fence too) and the directory: the first finds nothing to fence, raises nothing."""
    wid, ns_meta, incarnation = dead_writer(tmp_path, 8)
    cfg = cluster_config(tmp_path, "hostb")
    real_sync = rt.fsync_dir

    def other_retirer_first(path: Path) -> None:
        monkeypatch.setattr(rt, "fsync_dir", real_sync)  # the other retirer syncs for real
        assert rt.delete_writer(cfg, ns_meta, wid).finished
        real_sync(path)

    monkeypatch.setattr(rt, "fsync_dir", other_retirer_first)
    assert rt.write_fence(ns_meta / rt.writer_dirname(wid), incarnation, "hostb-0", "hostb") is False
    late = rt.retire(cfg, ns_meta, wid, incarnation, "hostb-0", "hostb")
    assert late.finished and late.files == 0 and files_of(tmp_path, wid) == []


def files_in(root: Path, wid: str) -> list[Path]:
    return sorted(p for d in files_of(root, wid) for p in d.iterdir())


def test_a_late_retirer_leaves_a_directory_made_anew_under_the_same_wid(tmp_path):
    """A retirement judged on the old incarnation reaches the wid after its directory was made anew by a
    live writer (a zombie re-registering takes the lowest free k): that writer's FENCE is empty and its lease
    another incarnation, so nothing of it is fenced or deleted."""
    wid, ns_meta, incarnation = dead_writer(tmp_path, 8)
    cfg = cluster_config(tmp_path, "hostb")
    assert rt.retire(cfg, ns_meta, wid, incarnation, "hostb-0", "hostb").finished  # the first retirer: all gone
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), NS) as a:
        assert a.wid == wid and put(a, [1, 2]) == [True, True]
        mine = files_in(tmp_path, wid)
        late = rt.delete_writer(cfg, ns_meta, wid)  # a quota step's continuation of the retirement it judged
        assert late.files == 0 and not late.finished and files_in(tmp_path, wid) == mine
        again = rt.retire(cfg, ns_meta, wid, incarnation, "hostc-0", "hostc")  # a retirer on the old lease
        assert again.files == 0 and not again.finished and files_in(tmp_path, wid) == mine
        assert read_fence(ns_meta / f"w-{wid}") is None  # its own FENCE is still empty
        beat(a)
        assert a.own is not None and a.own.fenced is None and read(a, [1, 2]) == ([1, 2], [], [])


def test_a_writer_restarted_into_its_directory_is_not_fenced_on_its_old_lease(tmp_path):
    """A writer of host A judged dead restarts into its own directory: from its first beat its lease names
    the new incarnation (it counts on above the old one's counter), so a retirer holding the old lease finds it
    moved and fences nothing."""
    wid, ns_meta, incarnation = dead_writer(tmp_path, 8)
    cfg = cluster_config(tmp_path, "hostb")
    with SharedPool.open_writer(cluster_config(tmp_path, "hosta"), NS) as a:
        assert a.wid == wid and a.own is not None and a.own.incarnation != incarnation  # adopted, warm
        lease = read_lease(ns_meta / f"w-{wid}" / "LEASE")
        assert lease is not None and lease["incarnation"] == a.own.incarnation
        assert not rt.write_fence(ns_meta / f"w-{wid}", incarnation, "hostb-0", "hostb")
        assert rt.retire(cfg, ns_meta, wid, incarnation, "hostb-0", "hostb").files == 0
        assert read(a, list(range(8))) == (list(range(8)), [], [])  # its pages, warm and still there


def test_files_a_paused_writer_makes_during_its_deletion_go_too(tmp_path, monkeypatch):
    """A writer only paused writes on until its next beat reads its fence: a checkpoint and a segment made
    after the deletion listed its directories go in another pass, before the fence; one still writing after
    ``SWEEPS`` passes keeps its fence, and a later step finishes."""
    wid, ns_meta, incarnation = dead_writer(tmp_path, 8)
    cfg = cluster_config(tmp_path, "hostb")
    meta = ns_meta / f"w-{wid}"
    seg_dir = files_of(tmp_path, wid)[0]  # its segments' directory (on one device: its meta directory)
    real_unlink, made = rt._unlink, []

    def zombie_writes(path: Path, done: rt.Deleted, size: bool = False) -> int:
        held = real_unlink(path, done, size)
        if path.name == "LOCK" and len(made) < limit:  # after each pass's listings: a checkpoint, a segment
            made.extend([meta / "checkpoint.bin", seg_dir / f"seg-{90 + len(made)}.dat"])
            for p in made[-2:]:
                p.write_bytes(b"z" * 4096)
        return held

    monkeypatch.setattr(rt, "_unlink", zombie_writes)
    limit = 2  # during the first pass only
    done = rt.retire(cfg, ns_meta, wid, incarnation, "hostb-0", "hostb")
    assert done.finished and done.passes == 3 and files_of(tmp_path, wid) == []  # 2 passes found files, 1 none

    wid, ns_meta, incarnation = dead_writer(tmp_path, 8)
    meta = ns_meta / f"w-{wid}"
    seg_dir = files_of(tmp_path, wid)[0]  # its segments' directory (on one device: its meta directory)
    made.clear()
    limit = 2 * rt.SWEEPS  # during every pass
    first = rt.retire(cfg, ns_meta, wid, incarnation, "hostb-0", "hostb")
    assert not first.finished and first.passes == rt.SWEEPS and read_fence(meta) is not None  # still fenced
    second = rt.delete_writer(cfg, ns_meta, wid)  # the writer has stopped: the next step finishes
    assert second.finished and second.files == 3 and files_of(tmp_path, wid) == []  # its last two files, FENCE


def test_a_retirer_behind_another_writes_no_fence_and_finishes(tmp_path):
    wid, ns_meta, incarnation = dead_writer(tmp_path, 8)
    cfg = cluster_config(tmp_path, "hostb")
    directory = ns_meta / f"w-{wid}"
    for d in files_of(tmp_path, wid):  # the first retirer is between FENCE's unlink and its rmdirs ...
        for path in d.iterdir():
            os.unlink(path)
    assert not rt.write_fence(directory, incarnation, "hostc-0", "hostc")
    assert not (directory / "FENCE").exists()  # ... and the second does not put a file back into it
    late = rt.retire(cfg, ns_meta, wid, incarnation, "hostc-0", "hostc")
    assert late.finished and not directory.exists()
    gone = rt.retire(cfg, ns_meta, wid, incarnation, "hostd-0", "hostd")  # the directory is gone: still fine
    assert gone.finished and gone.files == 0 and files_of(tmp_path, wid) == []
