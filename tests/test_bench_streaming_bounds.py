"""``benchmarks.streaming.bounds``: how low on/off can read by the off server's own phases, and its line under
the targets of ``bench_streaming``'s report."""

from __future__ import annotations

import pytest
from test_bench_streaming import _fake_run

from benchmarks.streaming import bounds
from benchmarks.streaming import report as stream_report
from sgl_kvtier.serving.client import PHASES

# Figures of a benchmark run (fast device, C = 1): off waited 0.130 s of 0.79 s; the rule learned k = 0.34 ms/MB
OFF = {"ttft_p50_s": 0.79, "phases_p50_s": {"prefetch_wait_s": 0.13, "forward_s": 0.654}}
ON = {"bind": {"bind_interference_seconds_per_megabyte": 0.34e-3}}
HIT_MB = 1536 * 131072 / 1e6


def test_the_ceiling_removes_the_whole_wait_then_adds_the_landings_interference() -> None:
    found = bounds.ceiling(OFF, ON, HIT_MB)
    assert found is not None
    assert found.free == pytest.approx((0.79 - 0.13) / 0.79)  # 0.835
    assert found.landing_s == pytest.approx(0.34e-3 * 201.326592)  # 0.068 s per 201 MB hit
    assert found.landing == pytest.approx((0.79 - 0.13 + found.landing_s) / 0.79)  # 0.92: over the 0.90 target
    assert bounds.ceiling_line("fast", 1, found) == (
        "fast C=1: on/off can read no lower than 0.84 (off's L3 wait p50 0.130 s of its TTFT p50 0.79 s, all of it "
        "removed, the landing free); 0.92 with the landing's learned interference (0.068 s per hit on the forward)")


def test_without_the_rules_figure_only_the_free_ceiling_and_without_phases_none() -> None:
    found = bounds.ceiling(OFF, {"bind": {}}, HIT_MB)
    assert found is not None and found.landing is None and found.landing_s is None
    assert bounds.ceiling_line("fast", 2, found).endswith("the landing free)")
    assert bounds.ceiling(OFF, None, HIT_MB) == found == bounds.ceiling(OFF, ON, None)  # no hit size: no landing
    assert bounds.ceiling({"ttft_p50_s": 0.79}, ON, HIT_MB) is None  # an older run: no phases
    assert bounds.ceiling({"ttft_p50_s": 0.0, "phases_p50_s": {"prefetch_wait_s": 0.1}}, ON, HIT_MB) is None


def test_the_report_lists_a_ceiling_per_device_with_phases_at_c_1() -> None:
    run = _fake_run()
    assert not any("can read no lower" in line for line in stream_report.targets(run))  # no phases: none
    run["workload"]["doc_tokens"] = 1536
    fast = run["servers"]["fast"]
    fast["off"]["levels"]["l3"]["1"]["phases_p50_s"] = dict(zip(PHASES, (0.01, 0.12, 0.0, 0.4, 0.01)))
    fast["on"]["levels"]["l3"]["1"]["bind"] = ON["bind"]
    fast["off"]["levels"]["l3"]["2"]["phases_p50_s"] = dict(zip(PHASES, (0.01, 0.5, 0.0, 0.4, 0.01)))  # not at C=2
    assert PHASES[1] == "prefetch_wait_s"
    [line] = [line for line in stream_report.targets(run) if "can read no lower" in line]
    off_p50 = fast["off"]["levels"]["l3"]["1"]["ttft_p50_s"]
    assert line.startswith(f"  - fast C=1: on/off can read no lower than {(off_p50 - 0.12) / off_p50:.2f} ")
    assert "(0.068 s per hit on the forward)" in line and line in stream_report.markdown(run)
