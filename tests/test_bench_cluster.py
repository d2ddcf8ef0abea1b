"""benchmarks.bench_cluster's pure parts: flags and their checks, where writers run and what they put and look
up, the refresh meter, the summary, the table, the report and the plot, on synthetic records.

No lab is built here: the benchmark end to end is its manual run (docs/benchmarks/sharing.md), and the lab
itself is tests/sharing/test_fs_lab*.py's.
"""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_cluster as bench
from benchmarks.cluster import report, workload
from benchmarks.cluster.pool_worker import RefreshMeter, key_of, page_of

MACHINE = {"cpu_model": "Test CPU", "cores": 2, "cores_usable": 2, "mem_gib": 8.0, "cpu_flags": {}}


def test_the_defaults_are_four_hosts_and_one_to_eight_writers_two_per_host():
    args = bench.parse_args([])
    assert args.hosts == 4 and args.per_host == 2 and args.writers == [1, 2, 4, 8]
    assert workload.placement(8, args.hosts) == [0, 1, 2, 3, 0, 1, 2, 3]  # two writers on each host
    assert args.out.name.startswith("cluster-")


@pytest.mark.parametrize(("flags", "says"), [
    (["--writers", "9"], "--writers 9 exceeds --hosts x --per-host = 8"),
    (["--hosts", "9"], "--hosts must be 1..8"),
    (["--writers", "0"], "at least 1"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--pages", "4", "--lookup-pages", "5"], "--lookup-pages must be 1..--pages (4)"),
    (["--page-kib", "6"], "--page-kib must be a positive multiple of 4"),
    (["--lookups", "0"], "--lookups must be at least 1"),
])
def test_each_bad_flag_is_refused_naming_it(flags, says, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(flags)
    assert says in capsys.readouterr().err


def test_the_pool_holds_every_page_a_run_puts():
    args = bench.parse_args(["--rounds", "3", "--pages", "10", "--page-kib", "64"])
    config = bench.pool_config(args, 4)
    assert config["capacity_bytes"] >= 4 * 3 * 10 * (64 * 1024 + 4096)
    assert config["sharing"] == "cluster" and config["dead_after_s"] >= 3 * config["heartbeat_s"]


def test_writers_put_disjoint_chains_and_look_up_the_others_in_turn():
    assert workload.round_keys(1, 2, 5) == list(range(workload.KEY_SPAN + 10, workload.KEY_SPAN + 15))
    assert not set(workload.round_keys(0, 0, 8)) & set(workload.round_keys(1, 0, 8))
    asked = workload.chains(0, 3, 1, 4, 8, 3, "fresh")
    assert [c["of"] for c in asked] == [2, 1, 2, 1] and {c["kind"] for c in asked} == {"fresh"}
    assert asked[0]["keys"] == workload.round_keys(2, 1, 8)[:3]  # the head of that writer's chain of the round
    alone = workload.chains(0, 1, 0, 2, 8, 8, "settled")
    assert [c["kind"] for c in alone] == ["own", "own"] and alone[0]["keys"] == workload.round_keys(0, 0, 8)
    assert workload.others_keys(1, 3, 0, 2) == workload.round_keys(0, 0, 2) + workload.round_keys(2, 0, 2)
    with pytest.raises(ValueError):
        workload.chains(0, 2, 0, 1, 4, 5, "fresh")
    with pytest.raises(ValueError):
        workload.chains(0, 2, 0, 1, 4, 2, "stale")


def test_pages_are_the_same_bytes_from_their_key_number_alone():
    assert page_of(7, 4096) == page_of(7, 4096) != page_of(8, 4096)
    assert len(key_of(7)) == 32 and key_of(7) != key_of(8)


def test_the_refresh_meter_counts_files_opened_under_its_root_and_bytes_read(tmp_path):
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "LEASE").write_bytes(b"x" * 20_000)
    (tmp_path / "elsewhere").write_bytes(b"y" * 100)
    originals = os.open, builtins.open
    meter = RefreshMeter(tmp_path / "pool")

    def refresh() -> None:
        with open(tmp_path / "pool" / "LEASE", "rb") as f:
            f.read()
        (tmp_path / "elsewhere").read_bytes()  # not under the root: not a file of the pool

    got = meter.measure(refresh)
    assert got["files"] == 1 and 20_000 <= got["bytes"] < 22_000 and got["s"] > 0
    assert meter.measure(lambda: None)["files"] == 0
    assert (os.open, builtins.open) == originals  # counting only while measuring


def records(kind: str, n: int, hits: int, asked: int = 4, wrong: int = 0, refresh_s: float = 0.01) -> list[dict[str, Any]]:
    return [{"kind": kind, "of": 1, "asked": asked, "prefix": hits, "hits": hits, "misses": asked - hits - wrong,
             "wrong": wrong, "refresh_s": refresh_s, "refresh_files": 3, "refresh_bytes": 10240, "lookup_s": 0.002}
            for _ in range(n)]


def test_a_summary_has_hit_rates_per_kind_wrong_pages_and_the_refresh_cost():
    s = report.summarize(records("settled", 4, 4) + records("fresh", 4, 1, refresh_s=0.03), 2, 2, [0.4, 0.6, 0.5])
    assert s["hit_rate"] == {"settled": 1.0, "fresh": 0.25, "own": None}
    assert s["wrong"] == 0 and s["lookups"] == 8 and s["pages_asked"] == 32
    assert s["refresh_p50_ms"] == pytest.approx(30.0) and s["refresh_p90_ms"] == pytest.approx(30.0)
    assert s["refresh_files"] == 3 and s["refresh_kib"] == 10.0 and s["visible_p50_ms"] == pytest.approx(500.0)
    assert report.summarize(records("own", 2, 4), 1, 1, [])["visible_p50_ms"] is None
    with pytest.raises(ValueError):
        report.summarize([], 1, 1, [])


def run_of(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    args = vars(bench.parse_args(["--writers", "1", "2", "--hosts", "2"]))
    return {"started": "2026-01-01 12:00:00 UTC", "command": "python -m benchmarks.bench_cluster --hosts 2",
            "machine": MACHINE, "juicefs": "1.4.2", "args": {k: str(v) for k, v in args.items()},
            "summaries": summaries}


def test_the_table_has_a_row_per_writer_count_and_the_report_its_header():
    alone = report.summarize(records("own", 2, 4), 1, 1, [])
    two = report.summarize(records("settled", 2, 4) + records("fresh", 2, 0, wrong=1), 2, 2, [0.5])
    text = report.table([alone, two])
    lines = text.splitlines()
    assert lines[0].startswith("| writers | hosts |") and len(lines) == 4
    assert lines[2].split(" | ")[3:7] == ["100.0%", "-", "0", "-"]  # alone: its own pages; no lag to wait for
    assert lines[3].split(" | ")[3:7] == ["100.0%", "0.0%", "2", "500"]
    md = report.markdown(run_of([alone, two]))
    assert "`python -m benchmarks.bench_cluster --hosts 2`" in md and "Test CPU, 2 cores" in md
    assert text in md and "A FAILURE" in md
    assert "per other writer (2 writers): a refresh opens 3.0 files and reads 10.0 KiB" in md
    assert "A FAILURE" not in report.markdown(run_of([alone])) and "per other writer" not in report.markdown(
        run_of([alone]))


def test_the_plot_is_written(tmp_path: Path):
    runs = [report.summarize(records("settled", 2, 4, refresh_s=0.001 * n), n, min(n, 4), [0.5]) for n in (1, 2, 4)]
    out = report.plot(run_of(runs), tmp_path / "cluster.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
