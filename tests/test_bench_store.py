"""benchmarks.bench_store: the page_first host pool against a real store, and a small run of both parts
(fio and the store on 128 pages of 1 MiB; the index measures on 5,000 synthetic pages)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from benchmarks import bench_store
from benchmarks.store.hostpool import HostPool
from benchmarks.store.stores import open_store


def test_host_pool_pages_round_trip_through_a_store(tmp_path: Path) -> None:
    src, dst = HostPool(8192, 8, np.random.default_rng(3)), HostPool(8192, 8)
    assert dst.read(5) == bytes(8192) and src.read(5) != src.read(6)
    k_addr, v_addr = (addr for addr, _ in src.runs(2))
    assert v_addr - k_addr == 8 * 4096  # page_first: all K halves, then all V halves
    with open_store(tmp_path, 8192, 64 * 8192, page_tokens=16, segment_bytes=1 << 20) as store:
        keys = [bytes([n]) * 32 for n in range(3)]
        assert store.put(keys, [src.runs(s) for s in (1, 4, 7)]) == [True] * 3
        assert store.get(keys, [dst.runs(s) for s in (0, 2, 3)]) == [True] * 3
    assert [dst.read(s) for s in (0, 2, 3)] == [src.read(s) for s in (1, 4, 7)]
    dst.write(6, src.read(1))
    assert dst.read(6) == src.read(1)
    dst.clear()
    assert dst.read(6) == bytes(8192)


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_small_run_writes_every_row(tmp_path: Path) -> None:
    out, scratch = tmp_path / "bench_store.json", tmp_path / "scratch"
    bench_store.main(["--page-mib", "1", "--total-gib", "0.01", "--rounds", "1", "--engines", "threads",
                      "--index-pages", "5000", "--reopen-repeats", "1", "--lookup-calls", "3",
                      "--profile", "--writers", "1", "2", "--dir", str(scratch), "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    rows = {r["metric"]: r for r in result["rows"]}
    get = "get cold" if result["cold_reads"] else "get WARM"
    assert set(rows) == {"kvtier[threads] put 1 MiB", f"kvtier[threads] {get} 1 MiB", "longest_prefix 4,096 keys",
                         "kvtier[threads] get 64 pages latency 1 MiB", "kvtier[threads] put 1 MiB x2 writers",
                         f"kvtier[threads] {get} 1 MiB x2 writers",
                         "reopen 0.005M pages (checkpoint)", "reopen 0.005M pages (journal replay)"}
    for name in ("kvtier[threads] put 1 MiB", f"kvtier[threads] {get} 1 MiB"):
        assert rows[name]["value"] > 0 and rows[name]["baseline"] > 0 and "engine=threads" in rows[name]["note"]
    assert "5,000 pages indexed" in rows["longest_prefix 4,096 keys"]["note"]
    assert rows["kvtier[threads] get 64 pages latency 1 MiB"]["value"] > 0
    phases = {op: {p["phase"] for p in result["profiles"][f"kvtier[threads] 1 MiB {op}"]} for op in ("put", "get")}
    assert {"put: write (phase total)", "io thread: write digests + trailer"} <= phases["put"]
    assert {"get: read (phase total)", "io thread: read digests (verify)"} <= phases["get"]
    assert rows["kvtier[threads] put 1 MiB x2 writers"]["value"] > 0
    assert rows["kvtier[threads] put 1 MiB x2 writers"]["baseline"] > 0
    (fio,) = result["fio_runs"]
    assert fio["page_mib"] == 1 and fio["bytes"] == 128 << 20 and fio["write"] > 0 and fio["read"] > 0
    machine = result["machine"]
    assert machine["fio"].startswith("fio-") and machine["model_dtype"].startswith("bf16") and machine["cpu_capability"]
    assert not scratch.exists()  # the run's scratch directory, made by the run, is gone
