"""The operator CLI: inspect, fsck and fsck --rebuild on a real store, exit codes, bad paths."""

from __future__ import annotations

import json

import pytest
from support import HostMemory, key, open_store

from sgl_kvtier.cli import main
from sgl_kvtier.store import format as fmt


def make_store(path, n=6):
    mem = HostMemory(n)
    with open_store(path) as store:
        for i in range(n):
            mem.fill(i, i)
        store.put([key(i) for i in range(n)], [mem.runs(i) for i in range(n)])
        return store.slot_bytes


def test_inspect_json(tmp_path, capsys):
    slot = make_store(tmp_path)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["pages"] == 6 and row["bytes_used"] == 6 * slot and row["format_version"] == fmt.FORMAT_VERSION
    assert row["devices"] == [str(tmp_path)] and row["locked_by_writer"] is None


def test_inspect_shows_a_live_writer(tmp_path, capsys):
    make_store(tmp_path)
    with open_store(tmp_path):
        assert main(["inspect", str(tmp_path), "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        assert row["locked_by_writer"] > 0


def test_fsck_finds_and_repairs(tmp_path, capsys):
    slot = make_store(tmp_path)
    assert main(["fsck", str(tmp_path)]) == 0
    (seg,) = tmp_path.glob("ns-*/w-*/seg-*.dat")
    with open(seg, "r+b") as f:
        f.seek(2 * slot + 10)
        f.write(b"\xff\xfe")
    capsys.readouterr()
    assert main(["fsck", str(tmp_path), "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["bad_pages"] == [key(2).hex()] and report["pages_checked"] == 6
    assert main(["fsck", str(tmp_path), "--repair"]) == 0
    assert main(["fsck", str(tmp_path)]) == 0


def test_fsck_rebuild_end_to_end(tmp_path, capsys):
    make_store(tmp_path)
    (meta,) = tmp_path.glob("ns-*/w-*")
    for p in [meta / "checkpoint.bin", *meta.glob("journal-*.log")]:
        p.unlink()
    capsys.readouterr()
    assert main(["fsck", str(tmp_path), "--rebuild", "--json"]) == 0
    (outcome,) = json.loads(capsys.readouterr().out)
    assert outcome["wid"] == meta.name[len("w-"):] and outcome["error"] is None
    assert outcome["report"]["pages"] == 6 and outcome["report"]["torn"] == 0
    assert main(["fsck", str(tmp_path), "--json"]) == 0  # every page verified against the rebuilt index
    (report,) = json.loads(capsys.readouterr().out)
    assert report["pages_checked"] == 6 and report["bad_pages"] == []
    mem = HostMemory(6)
    want = [mem.fill(i, i) for i in range(6)]
    mem.clear()
    with open_store(tmp_path) as store:
        assert store.get([key(i) for i in range(6)], [mem.runs(i) for i in range(6)]) == [True] * 6
        assert [mem.page(i).tobytes() for i in range(6)] == want
    assert main(["fsck", str(tmp_path), "--rebuild"]) == 0  # the table form
    assert "fsck --rebuild" in capsys.readouterr().out


def test_fsck_rebuild_leaves_a_live_writer_alone(tmp_path, capsys):
    make_store(tmp_path)
    with open_store(tmp_path):
        capsys.readouterr()
        assert main(["fsck", str(tmp_path), "--rebuild", "--json"]) == 1
        (outcome,) = json.loads(capsys.readouterr().out)
        assert outcome["report"] is None and "open for writing" in outcome["error"]


def test_fsck_rebuild_and_repair_are_exclusive(tmp_path, capsys):
    make_store(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["fsck", str(tmp_path), "--rebuild", "--repair"])
    assert exc.value.code == 2


def test_no_store_here(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no sgl-kvtier store" in capsys.readouterr().out
