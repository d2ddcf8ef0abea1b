"""verify.gates: every gate judged at every concurrency; no figure is no pass."""

from __future__ import annotations

import pytest

from sgl_kvtier.verify.gates import Gates, Verdict, evaluate, passed


def cell(p50: float, p99: float, rps: float, requests: int = 10, errors: int = 0) -> dict:
    return {"ttft_p50_s": p50, "ttft_p99_s": p99, "req_per_s": rps, "requests": requests, "errors": errors}


def by_gate(results, c):
    return {r.gate: r for r in results if r.concurrency == c}


def test_gains_are_judged_per_concurrency_against_the_baseline():
    base = {1: cell(2.0, 3.0, 1.0), 16: cell(20.0, 40.0, 1.0)}
    l3 = {1: cell(1.0, 2.5, 1.5), 16: cell(18.0, 20.0, 1.2)}
    res = evaluate(Gates(ttft_p99_cut=0.3), l3, base)
    one, sixteen = by_gate(res, 1), by_gate(res, 16)
    assert one["ttft_p50_cut"].achieved == pytest.approx(0.5) and one["ttft_p50_cut"].verdict is Verdict.PASS
    assert one["ttft_p99_cut"].achieved == pytest.approx(1 / 6) and one["ttft_p99_cut"].verdict is Verdict.FAIL
    assert one["throughput_gain"].achieved == pytest.approx(0.5) and one["throughput_gain"].verdict is Verdict.PASS
    assert sixteen["ttft_p50_cut"].achieved == pytest.approx(0.1) and sixteen["ttft_p50_cut"].verdict is Verdict.FAIL
    assert sixteen["throughput_gain"].achieved == pytest.approx(0.2) and sixteen["throughput_gain"].verdict is Verdict.FAIL
    assert sixteen["ttft_p99_cut"].verdict is Verdict.PASS
    assert one["error_rate"].verdict is Verdict.PASS and not passed(res)
    assert (one["ttft_p50_cut"].baseline, one["ttft_p50_cut"].value, one["ttft_p50_cut"].required) == (2.0, 1.0, 0.25)


def test_all_gates_met_pass_and_a_gate_set_to_none_is_not_judged():
    res = evaluate(Gates(ttft_p50_cut=0.25, throughput_gain=None), {4: cell(1.0, 2.0, 1.0)}, {4: cell(2.0, 4.0, 1.0)})
    assert {r.gate for r in res} == {"ttft_p50_cut", "error_rate"} and passed(res)


def test_missing_figures_are_no_data_and_fail_the_run():
    res = evaluate(Gates(), {1: cell(1.0, 2.0, 1.0), 4: {}}, {1: cell(1.0, 2.0, 0.0, requests=0)})
    assert all(r.verdict is Verdict.NO_DATA for r in res if r.gate != "error_rate")
    assert by_gate(res, 4)["error_rate"].verdict is Verdict.NO_DATA
    assert not passed(res) and not passed([])
    partial = evaluate(Gates(), {1: cell(1.0, 2.0, 2.0)}, {1: cell(2.0, 3.0, 1.0), 4: cell(2.0, 3.0, 1.0)}, levels=[1, 4])
    assert {r.verdict for r in partial if r.concurrency == 1} == {Verdict.PASS}
    assert {r.verdict for r in partial if r.concurrency == 4} == {Verdict.NO_DATA} and not passed(partial)


def test_errors_above_the_allowed_rate_fail():
    base = {1: cell(2.0, 3.0, 1.0)}
    assert by_gate(evaluate(Gates(), {1: cell(1.0, 2.0, 2.0, errors=1)}, base), 1)["error_rate"].verdict is Verdict.FAIL
    ok = evaluate(Gates(max_error_rate=0.1), {1: cell(1.0, 2.0, 2.0, errors=1)}, base)
    assert by_gate(ok, 1)["error_rate"].verdict is Verdict.PASS and passed(ok)


@pytest.mark.parametrize("kwargs", [{"ttft_p50_cut": 1.0}, {"ttft_p99_cut": 1.5}, {"max_error_rate": -0.1},
                                    {"max_error_rate": 2}])
def test_impossible_gates_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Gates(**kwargs)
