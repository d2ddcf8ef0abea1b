"""benchmarks.bench_landing: a small run (4 pages of 8 layers, read whole and in 4 and 2 read groups) on
SGLang's real host pool and our backend; every row is there and the IO counts follow the read groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from benchmarks import bench_landing  # noqa: E402


def test_small_run_lands_every_path_and_counts_its_ios(tmp_path: Path) -> None:
    out = tmp_path / "landing.json"
    result = bench_landing.main(["--pages", "4", "--layers", "8", "--kv-heads", "2", "--read-groups", "4", "2",
                                 "--rounds", "1", "--io-engine", "threads", "--dir", str(tmp_path / "scratch"),
                                 "--out", str(out)])
    assert result["stored_groups"] == 4 and result["hit_bytes"] == 4 * 2 * 8 * 16 * 2 * 64 * 4
    rows = {(r["path"], r["read_groups"]): r for r in result["summary"]}
    assert set(rows) == {("whole", None), ("streamed", 4), ("streamed", 2)}
    assert [rows[k]["ios"] for k in (("whole", None), ("streamed", 4), ("streamed", 2))] == [4, 4 * 2 * 4, 4 * 2 * 2]
    assert all(r["wall_s"] > 0 and r["cpu_s"] >= 0 for r in result["rows"])
    assert rows[("whole", None)]["cpu_per_io_s"] is None and rows[("streamed", 2)]["cpu_ratio"] is not None
    assert json.loads(out.read_text())["summary"] == json.loads(json.dumps(result["summary"]))
    assert result["args"]["io_engine"] == "threads"
    assert not (tmp_path / "scratch").exists()  # the store (and the scratch parent it made) removed
