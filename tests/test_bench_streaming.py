"""benchmarks.bench_streaming: the servers of a run and their order, the break-even device, the rounds, the
streaming counters, the on/off output comparison, the report, and a smoke run on real servers.

The smoke run (`--smoke`) starts two real SGLang servers on the CPU (tiny model, HiCache + sgl-kvtier L3 on the
fast device), `streaming = "off"` and `"on"`, up at once and taking turns (the interleaved schedule), each
serving a write round and two measured L3 rounds of one request (L1 + L2 flushed before each), the first
also a device-hit and a recompute round. About 2-3 minutes:
two start-ups dominate.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_streaming as bench
from benchmarks import common, machine
from benchmarks.serving import configs, workloads
from benchmarks.serving.policies import parse_device, prefix_rounds
from benchmarks.streaming import caveats, counters, outputs, paired, plan, plot, rounds, servers
from benchmarks.streaming import report as stream_report
from sgl_kvtier.config import Streaming
from sgl_kvtier.serving import summary
from sgl_kvtier.serving.client import PHASES

OFF, ON = Streaming.OFF, Streaming.ON


def test_servers_run_in_order_with_the_references_first() -> None:
    runs = plan.plan_servers(["breakeven", "fast", "slow:50"], [OFF, ON], references=True, breakeven_known=False)
    assert [(r.device, r.streaming, r.references) for r in runs] == [
        ("fast", OFF, True), ("fast", ON, False), ("slow:50", OFF, False), ("slow:50", ON, False),
        ("breakeven", OFF, False), ("breakeven", ON, False)]
    assert runs[2].tag == "slow-50-off"
    # The break-even rate comes from the references: they must run before, on another device, unless given.
    for devices, refs in ((["breakeven"], True), (["fast", "breakeven"], False)):
        with pytest.raises(ValueError, match="breakeven"):
            plan.plan_servers(devices, [OFF, ON], references=refs, breakeven_known=False)
    given = plan.plan_servers(["breakeven"], [ON], references=True, breakeven_known=True)
    assert [(r.device, r.streaming, r.references) for r in given] == [("breakeven", ON, True)]
    for bad in (["fast", "fast"], ["medium"], []):
        with pytest.raises(ValueError):
            plan.plan_servers(bad, [OFF], references=False, breakeven_known=True)
    assert plan.parse_modes(["on", "off", "on"]) == [OFF, ON]
    with pytest.raises(ValueError, match="streaming mode"):
        plan.parse_modes(["maybe"])


def test_a_twin_is_a_second_off_server_per_device() -> None:
    runs = plan.plan_servers(["breakeven", "fast"], [OFF, ON], references=True, breakeven_known=False, twin=OFF)
    assert [(r.device, r.key, r.references) for r in runs] == [
        ("fast", "off", True), ("fast", "on", False), ("fast", plan.TWIN_KEY, False),
        ("breakeven", "off", False), ("breakeven", "on", False), ("breakeven", plan.TWIN_KEY, False)]
    assert runs[2].streaming is OFF and runs[2].tag == "fast-off-twin" and runs[1].tag == "fast-on"
    with pytest.raises(ValueError, match="off mode"):
        plan.plan_servers(["fast"], [ON], references=False, breakeven_known=True, twin=OFF)
    args = bench.parse_args(["--devices", "fast", "--twin"])
    assert [r.key for r in args.server_runs] == ["off", "on", "off-twin"] and args.twin_env == {}
    # Three servers take turns; the order rotates with the round, so each takes each turn alike.
    trio = [r.key for r in args.server_runs]
    turns = [servers.order(trio, i) for i in range(3)]
    assert turns == [["off", "on", "off-twin"], ["on", "off-twin", "off"], ["off-twin", "off", "on"]]
    assert all(sorted(t[p] for t in turns) == sorted(trio) for p in range(3))
    assert servers.order(trio, 3) == turns[0]


def test_an_on_twin_runs_with_its_own_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = bench.parse_args(["--devices", "fast", "--twin", "on", "--twin-env", "GOMP_SPINCOUNT=1000",
                             "--server-env", "KVTIER_LAYER_LOADER=1", "--out", str(tmp_path)])
    assert [(r.key, r.streaming, r.twin) for r in args.server_runs] == [
        ("off", OFF, False), ("on", ON, False), (plan.ON_TWIN, ON, True)]
    assert plan.twin_of(plan.ON_TWIN) == "on" and plan.twin_of(plan.TWIN_KEY) == "off" and plan.twin_of("on") is None
    # The twin's environment is the others' plus --twin-env; the others never see it.
    device, base = parse_device("fast", 0.0), bench_plan(tmp_path)
    made = {r.key: servers.BenchServer(args, r, device, base, tmp_path, [], False, 1) for r in args.server_runs}
    common = {"KVTIER_PREFETCH_POLICY": "off", "KVTIER_LAYER_LOADER": "1"}
    assert made["on"].res["env"] == made["off"].res["env"] == common
    assert made[plan.ON_TWIN].res["env"] == common | {"GOMP_SPINCOUNT": "1000"}
    assert made[plan.ON_TWIN].srv.env["GOMP_SPINCOUNT"] == "1000" and "GOMP_SPINCOUNT" not in made["on"].srv.env
    assert made[plan.ON_TWIN].tag == "fast-on-twin" and made[plan.ON_TWIN].srv.log_path.name == "fast-on-twin.log"
    # Usage errors name the flag, before any server starts.
    for argv, words in ((["--twin-env", "GOMP_SPINCOUNT=1000"], "needs --twin"),
                        (["--twin", "on", "--twin-env", "GOMP_SPINCOUNT"], "--twin-env takes KEY=VALUE"),
                        (["--server-env", "=1"], "--server-env takes KEY=VALUE"),
                        (["--twin", "on", "--streaming", "off"], "needs the on mode"),
                        (["--devices", "breakeven", "--no-references"], "breakeven")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert words in capsys.readouterr().err


def bench_plan(root: Path) -> configs.ServerPlan:
    return configs.ServerPlan(page_size=16, device_tokens=256, host_ratio=2.0, host_size_gb=0, gpu=False,
                              l3_root=root / "l3", kvtier_capacity_bytes=1 << 30)


def test_break_even_rate_from_the_device_hits() -> None:
    nbytes = plan.prefix_bytes(1536, 16, 128 << 10)
    assert nbytes == 1536 * (128 << 10) and plan.prefix_bytes(1540, 16, 10) == 1536 * 10  # whole pages only
    assert plan.breakeven_mbps(nbytes, 0.5) == pytest.approx(nbytes / 0.5 / 1e6)
    for bad in ((0, 1.0), (nbytes, 0.0)):
        with pytest.raises(ValueError):
            plan.breakeven_mbps(*bad)

    def rec(ttft: float, device: int = 0, host: int = 0, **extra: object) -> dict:
        return {"ttft_s": ttft, "cached_device": device, "cached_host": host, "cached_storage": 0, **extra}

    mixed = [rec(0.9, host=512), rec(0.30, device=512), rec(0.34, device=512), rec(0.1, device=512, error="x")]
    value, basis = plan.suffix_compute_s(mixed)
    assert value == pytest.approx(0.32) and "2 pure device (L1) hits" in basis  # the L2 hit and the error left out
    assert plan.suffix_compute_s([rec(0.9, host=512), rec(0.7, host=512)])[0] == pytest.approx(0.8)
    with pytest.raises(ValueError):
        plan.suffix_compute_s([rec(0.1, error="x")])
    dev = plan.breakeven_device(559.24, 1000.0, 2.0)
    assert dev.name == "breakeven-559MBps"
    assert dev.throttle == {"read_bytes_per_s": 559.2e6, "write_bytes_per_s": 1000e6, "latency_s": 0.002}
    assert plan.resolve_device("breakeven", 2.0, dev) is dev and plan.resolve_device("fast", 2.0, None).throttle is None
    with pytest.raises(ValueError):
        plan.resolve_device("breakeven", 2.0, None)
    # The mode is set last: no --kvtier-extra can make an off server stream.
    extra = plan.server_extra(dev, {"streaming": "on", "io_depth": 4}, OFF)
    assert extra["streaming"] == "off" and extra["io_depth"] == 4 and extra["throttle"]["read_bytes_per_s"] == 559.2e6


def test_rounds_add_device_hits_and_recompute_after_the_l3_rounds() -> None:
    src = workloads.TokenSource(3, 1024, 0)
    shape = {"documents": 3, "doc_tokens": 64, "question_tokens": 16, "concurrency": [1, 2], "rounds": 1,
             "prime_rounds": 1, "max_new_tokens": 4, "reference_rounds": 1}
    plain = rounds.streaming_rounds(src, **shape, references=False)
    same = prefix_rounds(src, **{k: v for k, v in shape.items() if k != "reference_rounds"})
    assert [[q.tokens for q in r.requests] for r in plain] == [[q.tokens for q in r.requests] for r in same]
    full = rounds.streaming_rounds(src, **shape, references=True)
    assert [(r.kind, r.concurrency) for r in full] == [
        ("write", 2), ("prime", 1), ("measured", 1), ("measured", 2),
        ("device", 1), ("device", 2), ("recompute", 1), ("recompute", 2)]
    docs = {tuple(q.tokens[:64]) for q in full[0].requests}
    for rnd in full[4:6]:  # each document twice in a row, the L3 rounds' documents, new questions
        assert [q.group for q in rnd.requests] == ["d0", "d0", "d1", "d1", "d2", "d2"]
        assert {tuple(q.tokens[:64]) for q in rnd.requests} == docs
    for rnd in full[6:]:  # documents never seen: every token computed
        assert not {tuple(q.tokens[:64]) for q in rnd.requests} & docs
    rids = [q.rid for r in full for q in r.requests]
    assert len(rids) == len(set(rids))
    suffixes = [tuple(q.tokens[64:]) for r in full for q in r.requests]
    assert len(suffixes) == len(set(suffixes))
    assert [rounds.settles(r.kind) for r in full] == [False, True, True, True, False, False, False, False]


def test_counters_from_metrics_and_log() -> None:
    samples = [
        ("kvtier_stream_pages", {"tp_rank": "0"}, 10.0), ("kvtier_stream_pages", {"tp_rank": "1"}, 5.0),
        ("kvtier_stream_retracted_requests", {}, 1.0), ("kvtier_store_parts_read", {"pool": "kv"}, 64.0),
        ("sglang:num_retracted_requests_total", {}, 2.0), ("kvtier_store_get_hits", {}, 99.0),
    ]
    got = counters.read(samples)
    assert got == {"stream_pages": 15.0, "stream_retracted_requests": 1.0, "parts_read": 64.0,
                   "retracted_requests": 2.0}
    # By reason: the sum and one figure per reason; the bind rule's levels are no running totals.
    why = [("kvtier_stream_not_streamed", {"tp_rank": "0", "reason": "busy: loaded whole"}, 3.0),
           ("kvtier_stream_not_streamed", {"tp_rank": "0", "reason": "streaming not faster"}, 2.0),
           ("kvtier_stream_bind_whole_samples", {"tp_rank": "0"}, 7.0),
           ("kvtier_stream_bind_whole_samples", {"tp_rank": "1"}, 6.0),
           ("kvtier_stream_bind_interference_seconds_per_megabyte", {"tp_rank": "0"}, 0.002),
           ("kvtier_stream_bind_calls", {"tp_rank": "0"}, 4.0)]  # a hook counter, not a learned figure
    assert counters.read(why) == {"stream_not_streamed": 5.0, "stream_not_streamed[busy: loaded whole]": 3.0,
                                  "stream_not_streamed[streaming not faster]": 2.0, "stream_bind_calls": 4.0}
    assert counters.bind(why) == {"bind_whole_samples": 7.0, "bind_interference_seconds_per_megabyte": 0.002}
    moved = counters.delta(got, {"stream_pages": 5.0, "parts_failed": 1.0})
    assert moved["stream_pages"] == 10.0 and moved["parts_failed"] == -1.0 and moved["parts_read"] == 64.0
    assert counters.total([{"stream_counters": {"a": 1.0}}, {"stream_counters": {"a": 2.0, "b": 1.0}}, {}]) == \
        {"a": 3.0, "b": 1.0}
    log = ("[x] sgl_kvtier stream: tail of r1 retracted\nTraceback (most recent call last):\n"
           '  File "/w/sgl_kvtier/experiments/streaming/plugin.py", line 3, in load\nValueError: boom\n')
    counts = counters.log_counts(log)
    assert counts["sgl_kvtier_tracebacks"] == 1 and counts["retract_lines"] == 1 and counts["stream_lines"] >= 1


def _server(outs: dict[str, object], kind: str = "measured", c: int = 1) -> dict:
    reqs = []
    for rid, out in outs.items():
        if out is None:
            reqs.append({"rid": rid, "error": "no tokens streamed"})
        elif isinstance(out, str):
            reqs.append({"rid": rid, "text": out})
        else:
            reqs.append({"rid": rid, "output_ids": out, "text": "ignored when ids are there"})
    return {"rounds": [{"index": 2, "kind": kind, "concurrency": c, "requests": reqs}]}


def test_outputs_compared_request_by_request() -> None:
    off = _server({"a": [1, 2], "b": [3, 4], "c": "xy", "d": [5]})
    on = _server({"a": [1, 2], "b": [3, 5], "c": "xy", "d": None})
    got = outputs.compare(off, on)
    assert got == {"1": {"compared": 3, "identical": 2, "missing": 1, "different": ["b"]}}
    assert outputs.all_identical(got) is False
    same = outputs.compare(_server({"a": [1]}), _server({"a": [1]}))
    assert outputs.all_identical(same) is True
    # Only measured L3 rounds count: reference rounds are not on both servers.
    assert outputs.compare(_server({"a": [1]}, "device"), _server({"a": [2]}, "device")) == {}
    assert outputs.all_identical({}) is None


def test_the_write_round_is_the_control_of_the_comparison() -> None:
    """A document whose from-scratch write-round output already differs between the servers has different KV
    in each one's L3: its measured differences are not streaming's; the others are."""
    off = _server({"d6-q0": [1], "d7-q0": [2]}, "write")
    on = _server({"d6-q0": [9], "d7-q0": [2]}, "write")
    off["rounds"] += _server({"d6-q2": [3], "d7-q2": [4], "d8-q2": [5]})["rounds"]
    on["rounds"] += _server({"d6-q2": [0], "d7-q2": [0], "d8-q2": [5]})["rounds"]
    control = outputs.compare(off, on, outputs.CONTROL)
    assert control == {"1": {"compared": 2, "identical": 1, "missing": 0, "different": ["d6-q0"]}}
    assert outputs.attributable(outputs.compare(off, on), control) == ["d7-q2"]
    run = {"identical": {"fast": outputs.compare(off, on)}, "identical_control": {"fast": control}}
    (line,) = stream_report.control_lines(run)
    assert "1/2 identical, differing on d6" in line and line.endswith("control was identical: d7-q2")
    at_two = _server({"d7-q4": [1]}, c=2), _server({"d7-q4": [2]}, c=2)  # C > 1: batches differ, not counted
    assert outputs.attributable(outputs.compare(*at_two), control) == []


def test_schedule_alternates_who_serves_a_round_first() -> None:
    group = ["off", "on"]
    assert servers.batches(servers.Schedule.INTERLEAVED, group) == [["off", "on"]]
    assert servers.batches(servers.Schedule.SEQUENTIAL, group) == [["off"], ["on"]]
    assert [servers.order(group, i) for i in range(4)] == [["off", "on"], ["on", "off"]] * 2
    assert servers.Schedule("interleaved") is servers.Schedule.INTERLEAVED and str(servers.Schedule.SEQUENTIAL) == \
        "sequential"
    assert bench.parse_args([]).schedule is servers.Schedule.INTERLEAVED
    assert bench.parse_args(["--schedule", "sequential"]).schedule is servers.Schedule.SEQUENTIAL


def _timed(rounds_: dict[int, dict[str, float | None]], c: int = 1) -> dict:
    """A server record whose measured round i has requests rid -> TTFT (None: the request failed)."""
    return {"rounds": [{"index": i, "kind": "measured", "concurrency": c,
                        "requests": [{"rid": rid, "error": "x"} if t is None else {"rid": rid, "ttft_s": t}
                                     for rid, t in reqs.items()]} for i, reqs in rounds_.items()]}


def test_paired_ratios_compare_the_same_request_on_both_servers() -> None:
    off = _timed({2: {"a": 1.0, "b": 2.0, "c": 1.0}, 3: {"a": 1.0, "b": 1.0}})
    on = _timed({2: {"a": 0.8, "b": 1.0, "c": None}, 3: {"a": 0.9, "b": 0.9}})
    got = paired.compare(off, on)
    # c failed on the on server: left out of both figures. Ratios per request: 0.8, 0.5, 0.9, 0.9.
    assert got == {"1": {"requests": 4, "median_ratio": pytest.approx(0.85),
                         "round_ratios": [pytest.approx(0.9 / 1.5), pytest.approx(0.9)]}}
    assert paired.compare(off, _timed({}, 1)) == {}
    mixed = _timed({2: {"a": 1.0}}) | {"rounds": _timed({2: {"a": 1.0}})["rounds"] + _timed({5: {"x": 2.0}}, 2)["rounds"]}
    assert set(paired.compare(mixed, mixed)) == {"1", "2"}
    run = {"paired": {"fast": got}}
    assert stream_report.paired_text(run, "fast", 1) == "0.85 (rounds 0.60-0.90)"
    assert stream_report.paired_text(run, "fast", 2) == "-"


def _summary(ttft: float, storage: int, unfulfilled: float = 0.0) -> dict:
    reqs = [{"rid": f"r{i}", "ttft_s": ttft * (1 + i / 10), "latency_s": ttft, "prompt_tokens": 1600,
             "cached_device": 0, "cached_host": 0, "cached_storage": storage} for i in range(5)]
    s = summary.summarize([{"measured": True, "wall_s": 2.0, "requests": reqs,
                           "metrics_delta": {"prefetched_tokens": 5.0 * storage,
                                             "unfulfilled_storage_transfer": unfulfilled}}], 1000)
    return s | {"stream": {"stream_pages": 40.0, "parts_read": 640.0, "retracted_requests": 0.0}}


def _fake_run() -> dict:
    be = "breakeven-559MBps"
    l3 = {("fast", "off"): 0.50, ("fast", "on"): 0.44, (be, "off"): 1.00, (be, "on"): 0.75}
    servers: dict = {"fast": {}, be: {}}
    for (dev, mode), t in l3.items():
        levels = {"l3": {"1": _summary(t, 1536), "2": _summary(2 * t, 1536)}}
        servers[dev][mode] = {"command_str": "python -m sglang.launch_server", "env": {"KVTIER_PREFETCH_POLICY": "off"},
                              "startup_s": 30.0, "levels": levels, "log_counts": {"sgl_kvtier_tracebacks": 0}}
    servers["fast"]["off"]["levels"] |= {"device": {"1": _summary(0.36, 0)}, "recompute": {"1": _summary(2.9, 0)}}
    servers[be]["on"]["levels"]["l3"]["2"] = _summary(2.2, 0, unfulfilled=1536)  # on recomputed its hits
    return {
        "started": "now", "gpu": False, "model": {"name": "kvheavy", "kv_bytes_per_token": 131072},
        "sizing": {"page_size": 16, "device_tokens": 100, "host_tokens": 200}, "page_cache": "dropped",
        "prefetch_policy": "timeout", "workload": {"description": "d"}, "modes": ["off", "on"],
        "device_order": ["fast", be],
        "devices": {"fast": {"spec": "fast", "description": "fast"}, be: {"spec": "breakeven", "description": "be"}},
        "servers": servers, "references": {"device": "fast", "streaming": "off"},
        "identical": {"fast": {"1": {"compared": 5, "identical": 5, "missing": 0, "different": []}},
                      be: {"1": {"compared": 5, "identical": 4, "missing": 0, "different": ["r3"]}}},
        "breakeven": {"source": "measured", "mbps": 559.2, "compute_s": 0.36, "basis": "median TTFT of 8 pure "
                      "device (L1) hits", "concurrency": 1, "prefix_bytes": 201326592, "write_mbps": 1000.0},
    }  # fmt: skip


def test_report_table_targets_and_plot(tmp_path: Path) -> None:
    run = _fake_run()
    md = stream_report.markdown(run)
    fast = md.split("## fast")[1].split("## breakeven")[0]
    on1 = next(line for line in fast.splitlines() if line.startswith("| on | 1 |"))
    assert "| 0.88 | 0.88 |" in on1 and "| 5/5 |" in on1 and "stream_pages=40" not in on1 and "pages=40" in on1
    assert "| 640 |" in on1 and "| 0.88 | 0.88 | - |" in on1  # no paired figures in this run
    assert "Schedule: sequential" in md
    run["paired"] = {"fast": {"1": {"requests": 10, "median_ratio": 0.87, "round_ratios": [0.85, 0.9]}}}
    run["schedule"] = "interleaved"
    md = stream_report.markdown(run)
    assert "| 0.88 | 0.88 | 0.87 (rounds 0.85-0.90) |" in md and "Schedule: interleaved" in md
    assert "fast C=1: MET (on 0.53 s / off 0.60 s = 0.88; paired 0.87 (rounds 0.85-0.90))" in \
        stream_report.targets(run)[1]
    del run["paired"]
    run["servers"]["fast"]["on"]["levels"]["l3"]["1"]["bind"] = {
        "bind_whole_wait_fixed_seconds": 0.04, "bind_whole_wait_seconds_per_megabyte": 0.0016,
        "bind_whole_samples": 9.0, "bind_interference_samples": 1.0,
        "bind_measured_whole_seconds_per_megabyte": 0.002, "bind_measured_whole_hits": 16.0,
        "bind_measured_stream_hits": 1.0}
    assert stream_report.bind_lines(run, "fast") == [
        "- C=1, bind rule after the last round: whole-load wait W = 0.040 s + 1.60 ms/MB (9 samples); "
        "interference k = not learned (1 samples); load-back X = not learned (0 samples); measured over compute: "
        "whole 2.00 ms/MB (16 hits); stream not learned (1 hits)"]
    assert "whole-load wait W = 0.040 s" in stream_report.markdown(run)
    assert "| device hit (L1/L2) | 1 | 0.43 |" in md and "| recompute | 1 | 3.48 |" in md  # p50 = 1.2 x base
    assert "Break-even read rate 559.2 MB/s, derived: 201.3 MB of KV per prefix / suffix compute 0.360 s" in md
    lines = stream_report.targets(run)
    assert lines[0].startswith("- break-even device, C = 1") and "breakeven-559MBps C=1: MET" in lines[0]
    assert "= 0.75" in lines[0] and "fast" not in lines[0].split(":", 1)[1]
    assert "fast C=1: MET (on 0.53 s / off 0.60 s = 0.88)" in lines[1]
    assert "fast C=2: MET" in lines[2] and "breakeven-559MBps C=2: NOT MET" in lines[2]
    assert "[on recomputed L3 hits" in lines[2]
    assert lines[3] == "- outputs identical on/off (greedy): fast: yes; breakeven-559MBps: NO"
    assert lines[4].startswith("- WARNING") and "breakeven-559MBps C=2: on served 0 L3 tokens" in lines[4]
    assert not any("withheld cap" in line for line in lines)
    run["servers"]["fast"]["on"]["levels"]["l3"]["1"]["stream"][caveats.CAPPED] = 3.0  # 3 of 5 loaded whole
    held = stream_report.targets(run)[-1]
    assert held.startswith("- WARNING, hits loaded whole because the withheld cap") and held.endswith(
        ": fast on C=1: 3 of 5 requests")
    del run["servers"]["fast"]["on"]["levels"]["l3"]["1"]["stream"][caveats.CAPPED]
    assert "Where the TTFT went" not in md  # no cell has phases
    phases = dict(zip(PHASES, (0.01, 0.2, 0.02, 0.25, 0.02)))
    run["servers"]["fast"]["on"]["levels"]["l3"]["1"]["phases_p50_s"] = phases
    run["servers"]["fast"]["off"]["levels"]["device"]["1"]["phases_p50_s"] = phases
    table = stream_report.phase_table(run, "fast")
    assert table.splitlines()[0] == ("| requests | C | TTFT p50 s | received s | prefetch wait s | queued s | "
                                     "forward s | returned s | sum of p50s |")
    assert table.splitlines()[2:] == ["| L3 hit, streaming on | 1 | 0.53 | 0.010 | 0.200 | 0.020 | 0.250 | 0.020 | 0.50 |",
                                      "| device hit (L1/L2) | 1 | 0.43 | 0.010 | 0.200 | 0.020 | 0.250 | 0.020 | 0.50 |"]
    assert stream_report.phase_table(run, "breakeven-559MBps") == "" and table in stream_report.markdown(run)
    assert stream_report.thread_table(run, "fast") == "" and "Where the CPU went" not in stream_report.markdown(run)
    run["servers"]["fast"]["off"]["levels"]["l3"]["1"]["thread_cpu_s"] = {"sglang::scheduler": 4.0, "kvtier-io": 0.15}
    run["servers"]["fast"]["on"]["levels"]["l3"]["1"]["thread_cpu_s"] = {
        "sglang::scheduler": 4.5, "kvtier-io": 0.6, "kvtier-parts": 0.25, "kvtier-stream": 0.001}
    cpu = stream_report.thread_table(run, "fast").splitlines()  # 5 requests per cell: ms per request
    assert cpu[0] == "| streaming | C | sglang::scheduler | kvtier-io | kvtier-parts | total |"  # busiest first
    assert cpu[2:] == ["| off | 1 | 800 | 30 | 0 | 830 |", "| on | 1 | 900 | 120 | 50 | 1070 |"]  # total: all
    assert "Where the CPU went" in stream_report.markdown(run)
    twin_free = stream_report.markdown(run)
    assert "noise floor (" not in twin_free and "| off-twin |" not in twin_free
    run["servers"]["fast"][plan.TWIN_KEY] = {"levels": {"l3": {"1": _summary(0.55, 1536)}}, "command_str": "twin"}
    run["paired_twin"] = {"fast": {"1": {"requests": 8, "median_ratio": 1.03, "round_ratios": [0.98, 1.06]}}}
    rows = stream_report.table(run, "fast").splitlines()
    twin_row = next(line for line in rows if line.startswith("| off-twin | 1 |"))
    assert "| 0.66 | 0.77 | 1.10 | 1.10 | 1.03 (rounds 0.98-1.06) |" in twin_row  # 0.55 x 1.2 over off's 0.50 x 1.2
    assert "  - fast C=1, noise floor (a second off server, interleaved): off-twin / off 1.10, paired 1.03 " \
        "(rounds 0.98-1.06)" in stream_report.targets(run)
    assert "| L3 hit, streaming off-twin |" not in stream_report.phase_table(run, "fast")  # no phases in the twin
    assert plot.plot(run, tmp_path).exists()
    # An on twin with more environment: its row against off, its line against on (paired_twin: on-twin / on).
    env = run["servers"]["fast"]["on"]["env"]
    run["servers"]["fast"][plan.ON_TWIN] = run["servers"]["fast"].pop(plan.TWIN_KEY) | {
        "env": env | {"GOMP_SPINCOUNT": "1000"}}
    run["paired_twin"]["fast"]["1"]["median_ratio"] = 0.96
    run["paired_on_twin"] = {"fast": {"1": {"requests": 8, "median_ratio": 1.01, "round_ratios": [1.0, 1.02]}}}
    run["identical_twin"] = {"fast": {"1": {"compared": 5, "identical": 5, "missing": 0, "different": []}}}
    rows = stream_report.table(run, "fast").splitlines()
    twin_row = next(line for line in rows if line.startswith("| on-twin | 1 |"))
    assert "| 0.66 | 0.77 | 1.10 | 1.10 | 1.01 (rounds 1.00-1.02) |" in twin_row and "| 5/5 |" in twin_row
    assert "  - fast C=1, with GOMP_SPINCOUNT=1000: on-twin / on 1.25, paired 0.96 (rounds 0.98-1.06); outputs "         "identical to off 5/5" in stream_report.targets(run)  # 0.55 over on's 0.44
    assert "noise floor (" not in stream_report.markdown(run)
    assert plot.plot(run, tmp_path).exists()
    del run["servers"]["fast"][plan.ON_TWIN]
    run["servers"]["fast"]["on"]["levels"] = {}
    assert "fast C=1: not measured" in stream_report.targets(run)[1]
    path = plot.plot(run, tmp_path)
    assert path.name == "ttft_streaming.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_args_smoke_modes_and_environment() -> None:
    args = bench.parse_args(["--smoke", "--documents", "2", "--server-env", "KVTIER_LAYER_LOADER=1",
                             "--server-env", "KVTIER_PREFETCH_POLICY=cost"])
    assert args.model == "tiny" and args.documents == 2 and args.concurrency == [1] and args.rounds == 2
    assert args.env == {"KVTIER_PREFETCH_POLICY": "cost", "KVTIER_LAYER_LOADER": "1"}
    assert [(r.device, r.streaming.value, r.references) for r in args.server_runs] == [
        ("fast", "off", True), ("fast", "on", False)]
    full = bench.parse_args([])
    assert full.model == "kvheavy" and full.devices == ["fast", "breakeven"] and full.concurrency == [1, 2, 4]
    assert full.env == {"KVTIER_PREFETCH_POLICY": "off"} and len(full.server_runs) == 4
    assert parse_device("slow:5", 0).name == "slow-5MBps"


@pytest.mark.server
def test_smoke_run(tmp_path: Path) -> None:
    pytest.importorskip("sglang")
    from sgl_kvtier.serving.model_factory import make_model

    model = make_model(tmp_path / "model", "tiny")
    out = tmp_path / "out"
    rc = bench.main(["--smoke", "--model", str(model), "--no-drop-caches", "--no-progress", "--cpu", "--out", str(out)])
    assert rc == 0
    for name in ("results.json", "report.md", "ttft_streaming.png"):
        assert (out / name).stat().st_size > 0, name
    run = json.loads((out / "results.json").read_text())
    assert run["device_order"] == ["fast"] and run["breakeven"] is None
    assert run["references"] == {"device": "fast", "streaming": "off"}
    for mode, res in run["servers"]["fast"].items():
        assert "error" not in res, res.get("error")
        assert res["log_counts"]["sgl_kvtier_tracebacks"] == 0
        cfg = json.loads(res["command"][res["command"].index("--hicache-storage-backend-extra-config") + 1])
        assert cfg["streaming"] == mode
        kinds = [r["kind"] for r in res["rounds"]]
        assert kinds == (["write", "measured", "measured", "device", "recompute"] if mode == "off"
                         else ["write", "measured", "measured"])
        for rnd in res["rounds"]:
            assert all("error" not in q and q["ttft_s"] > 0 and q["output_ids"] for q in rnd["requests"])
            for q in rnd["requests"]:  # SGLang's own stamps cut every TTFT into phases that add up to it
                assert set(q["phases"]) == set(PHASES) and sum(q["phases"].values()) == pytest.approx(q["ttft_s"], abs=1e-5)
                assert q["phases"]["forward_s"] > 0 and q["phases"]["prefetch_wait_s"] >= 0, q["phases"]
            if rnd["kind"] == "measured":
                assert rnd["settle"]["backups"]["settled"] and rnd["settle"]["flush_s"] >= 0
        assert res["levels"]["l3"]["1"]["requests"] == 2
        # CPU by thread group in every measured round: positive figures only, SGLang's processes by name.
        cpu = [rnd["thread_cpu_s"] for rnd in res["rounds"]]
        assert all(v > 0 for c in cpu for v in c.values())
        assert any(k.startswith("sglang::") for c in cpu for k in c), cpu
    off = run["servers"]["fast"]["off"]
    # After the flush each document prefix (512 tokens) comes from L3 on today's path.
    assert [q["cached_storage"] for r in off["rounds"] if r["kind"] == "measured" for q in r["requests"]] == [512, 512]
    assert off["levels"]["device"]["1"]["cached_tokens"]["device"] == 1024  # both of the pair hit L1
    assert off["levels"]["recompute"]["1"]["computed_tokens"] == 544
    assert run["identical"]["fast"] == {"1": {"compared": 2, "identical": 2, "missing": 0, "different": []}}
    # Interleaved (the default): both servers up at once, round i served by one then the other, the first
    # alternating; each round records its peer's CPU seconds meanwhile and its own write-back drained.
    on = run["servers"]["fast"]["on"]
    assert run["schedule"] == "interleaved"
    assert [o["started"] < n["started"] for o, n in zip(off["rounds"], on["rounds"])] == [True, False, True]
    for rnd in off["rounds"] + on["rounds"]:
        assert len(rnd["peer_cpu_s"]) == 1 and rnd["peer_cpu_s"][0] >= 0 and rnd["drained"]["settled"]
    assert "--sleep-on-idle" in off["command"] and "--sleep-on-idle" in on["command"]
    assert run["paired"]["fast"]["1"]["requests"] == 2 and len(run["paired"]["fast"]["1"]["round_ratios"]) == 2
    md = (out / "report.md").read_text()
    assert "## fast" in md and "| off | 1 |" in md and "| on | 1 |" in md and "| device hit (L1/L2) | 1 |" in md
    assert "| L3 hit, streaming on | 1 |" in md and "Where the TTFT went" in md
    assert "outputs identical on/off (greedy): fast: yes" in md


def test_memory_short_warns_where_the_servers_up_at_once_do_not_fit(tmp_path: Path) -> None:
    from sglang.srt.mem_cache.pool_host import base

    assert plan.SGLANG_HOST_RESERVE_BYTES == base.HICACHE_HOST_MEMORY_RESERVE_BYTES
    kv, weights, available = 128 << 10, 226 << 20, int(22.8e9)  # kvheavy; a 23 GB VM with the bench running
    # On that VM, C = 2 4, three servers (device pool 8,048 tokens): --host-ratio 5 and 2.5 both lost the third
    # server to SGLang's host check; C = 1, --host-ratio 5 (2,016 + 10,080 tokens) started all three.
    for host in (40240, 20120):
        short = plan.memory_short(3, (8048 + host) * kv, weights, available)
        assert short is not None and "--host-ratio" in short and "10 GiB host reserve" in short
    assert plan.memory_short(3, (8048 + 20120) * kv, weights, available).startswith("3 servers up at once need ~28.8 GB")
    assert plan.memory_short(3, (2016 + 10080) * kv, weights, available) is None
    assert plan.memory_short(1, (8048 + 40240) * kv, weights, available) is None  # --schedule sequential
    assert plan.memory_short(3, 10**12, 0, None) is None  # availability unknown: no claim
    (tmp_path / "m" / "sub").mkdir(parents=True)
    (tmp_path / "m" / "a.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "m" / "sub" / "b").write_bytes(b"y" * 28)
    assert common.files_bytes(tmp_path / "m") == 128 and common.files_bytes(tmp_path / "m" / "a.safetensors") == 100
    assert common.files_bytes(tmp_path / "none") == 0
    assert machine.memory_available_bytes() is None or machine.memory_available_bytes() > 0
