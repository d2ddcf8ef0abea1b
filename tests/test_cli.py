"""The operator CLI: inspect and fsck on a real store, exit codes, bad paths."""

from __future__ import annotations

import json

from support import HostMemory, key, open_store

from sgl_kvtier.cli import main


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
    assert row["pages"] == 6 and row["bytes_used"] == 6 * slot and row["format_version"] == 1
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
    (seg,) = tmp_path.glob("ns-*/seg-*.dat")
    with open(seg, "r+b") as f:
        f.seek(2 * slot + 10)
        f.write(b"\xff\xfe")
    capsys.readouterr()
    assert main(["fsck", str(tmp_path), "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["bad_pages"] == [key(2).hex()] and report["pages_checked"] == 6
    assert main(["fsck", str(tmp_path), "--repair"]) == 0
    assert main(["fsck", str(tmp_path)]) == 0


def test_no_store_here(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no sgl-kvtier store" in capsys.readouterr().out
