"""``benchmarks.streaming.caveats``: the warnings under ``bench_streaming``'s targets, here the cells where
the streaming server streamed few of its hits (its on/off then compares mostly the same path)."""

from __future__ import annotations

from test_bench_streaming import _fake_run

from benchmarks.streaming import caveats
from benchmarks.streaming import report as stream_report


def test_a_streaming_server_that_streamed_under_half_its_hits_is_named_with_why() -> None:
    run = _fake_run()
    assert caveats.few_streamed(run) == []  # no tail counter (an older run, or none exported): not judged
    on = run["servers"]["fast"]["on"]["levels"]["l3"]["1"]
    assert on["requests"] == 5
    on["stream"] |= {"stream_tails": 1.0, "stream_not_streamed[measured no faster: loaded whole]": 3.0,
                     "stream_not_streamed[no tail]": 4.0, "stream_not_streamed[busy: loaded whole]": 1.0,
                     "stream_not_streamed[withheld cap: loaded whole]": 0.0}
    assert caveats.few_streamed(run) == [
        "fast on C=1: 1 of 5 (measured no faster: loaded whole 3, busy: loaded whole 1)"]
    [line] = [t for t in stream_report.targets(run) if "streamed under half" in t]
    assert line.startswith("- WARNING") and line.endswith(": fast on C=1: 1 of 5 (measured no faster: loaded "
                                                          "whole 3, busy: loaded whole 1)")
    on["stream"]["stream_tails"] = 3.0  # 3 of 5: over half, a streaming figure
    assert caveats.few_streamed(run) == []
