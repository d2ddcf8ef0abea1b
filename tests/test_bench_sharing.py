"""benchmarks.bench_sharing: flags, the four configurations' server and router command lines, who served
what (request logs, alternation), and the report's ratios and targets on synthetic results.

No server, router or store is started here: the harness itself is proven by a manual smoke run
(benchmarks/README.md, "bench_sharing").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_sharing as bench
from benchmarks.serving import configs, router, sharing, sharing_report, workloads


def plan(tmp_path: Path) -> configs.ServerPlan:
    return configs.ServerPlan(page_size=16, device_tokens=4096, host_ratio=2.0, host_size_gb=0, gpu=False,
                              l3_root=tmp_path / "l3", kvtier_capacity_bytes=10**9)


def extra_config(args: list[str]) -> dict[str, Any]:
    return dict(json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1]))


def wl(clients: int = 3, rounds: int = 3) -> workloads.Workload:
    return workloads.multiturn(workloads.TokenSource(3, 1024, 0), clients=clients, rounds=rounds, system_tokens=64,
                               user_tokens=32, answer_tokens=16, max_new_tokens=4)


# -- flags ----------------------------------------------------------------------------------------


def test_defaults_run_all_four_configurations_with_an_odd_number_of_conversations() -> None:
    args = bench.parse_args([])
    assert [c.name for c in args.configs] == ["radix", "kvtier-per-instance", "file-shared", "kvtier-shared"]
    assert args.clients % 2 == 1 and args.rounds >= 2
    assert (args.frontend, args.cores_per_server, args.model) == ("router", 1, "bench")


def test_aliases_resolve_in_canonical_order_and_unknown_names_fail() -> None:
    args = bench.parse_args(["--configs", "shared,file", "radix", "per-instance", "radix"])
    assert [c.name for c in args.configs] == ["radix", "kvtier-per-instance", "file-shared", "kvtier-shared"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "nope"])


def test_even_conversation_counts_and_a_single_round_are_refused() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--clients", "4"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "1"])
    assert bench.parse_args(["--clients", "5", "--frontend", "client"]).frontend == "client"


# -- command lines --------------------------------------------------------------------------------


def test_shared_configurations_point_both_instances_at_one_directory(tmp_path: Path) -> None:
    p = plan(tmp_path)
    kv, fl = sharing.CONFIGS["kvtier-shared"], sharing.CONFIGS["file-shared"]
    a, b = (extra_config(kv.args(p, i)) for i in range(2))
    assert a["devices"] == b["devices"] and len(a["devices"]) == 1
    assert a["sharing"] == b["sharing"] == "host" and a["class_name"] == "KVTierStorage"
    assert kv.l3_dirs(p) == [Path(a["devices"][0])]
    fa, fb = (extra_config(fl.args(p, i)) for i in range(2))
    assert fa["file_storage_path"] == fb["file_storage_path"]
    assert fl.l3_dirs(p) == [Path(fa["file_storage_path"])]
    assert all("--hicache-storage-backend" in c.args(p, 0) for c in (kv, fl))


def test_the_cluster_configuration_makes_each_instance_a_host_of_its_own(tmp_path: Path) -> None:
    """Opt-in (not among the defaults): one directory, sharing = cluster, a host_id per instance, and the
    local-filesystem refusal waived (one machine stands for two hosts)."""
    p = plan(tmp_path)
    cl = sharing.CONFIGS["kvtier-cluster"]
    a, b = (extra_config(cl.args(p, i)) for i in range(2))
    assert a["devices"] == b["devices"] and a["devices"] != extra_config(sharing.CONFIGS["kvtier-shared"].args(p, 0))["devices"]
    assert a["sharing"] == b["sharing"] == "cluster" and a["allow_local_fs"] is True
    assert (a["host_id"], b["host_id"]) == ("h0", "h1")
    assert "kvtier-cluster" not in sharing.DEFAULT and sharing.resolve(["cluster"]) == [cl]


def test_per_instance_kvtier_gets_two_directories_and_radix_none(tmp_path: Path) -> None:
    p = plan(tmp_path)
    per = sharing.CONFIGS["kvtier-per-instance"]
    a, b = (extra_config(per.args(p, i)) for i in range(2))
    assert a["devices"] != b["devices"] and "sharing" not in a
    assert per.l3_dirs(p) == [Path(a["devices"][0]), Path(b["devices"][0])]
    radix = sharing.CONFIGS["radix"].args(p, 0)
    assert "--enable-hierarchical-cache" not in radix and "--hicache-storage-backend" not in radix
    assert sharing.CONFIGS["radix"].l3_dirs(p) == []
    # The same pools for every configuration and instance.
    for c in sharing.CONFIGS.values():
        args = c.args(p, 1)
        assert args[args.index("--max-total-tokens") + 1] == "4096"


def test_each_instance_logs_its_requests_into_its_own_directory(tmp_path: Path) -> None:
    args = sharing.CONFIGS["kvtier-shared"].args(plan(tmp_path), 1, tmp_path / "w1")
    assert args[args.index("--log-requests-target") + 1] == str(tmp_path / "w1")
    assert args[args.index("--log-requests-format") + 1] == "json" and "--log-requests" in args


def test_instances_are_pinned_to_distinct_cpus_when_there_are_enough() -> None:
    assert sharing.pinning([1, 0], 2, 1) == [[0], [1]]
    assert sharing.pinning([0, 1, 2, 3], 2, 2) == [[0, 1], [2, 3]]
    assert sharing.pinning([0], 2, 1) == [[], []] and sharing.pinning([0, 1], 2, 0) == [[], []]
    assert sharing.pinned_command(["python", "-m", "x"], [3]) == ["taskset", "-c", "3", "python", "-m", "x"]
    assert sharing.pinned_command(["python"], []) == ["python"]


def test_server_commands_carry_the_pinning_and_flags(tmp_path: Path) -> None:
    args = bench.parse_args(["--out", str(tmp_path), "--cpu"])
    servers, logs = bench.make_servers(args, sharing.CONFIGS["file-shared"], plan(tmp_path), tmp_path / "model",
                                       [[0], [1]])
    assert [s.command[:3] for s in servers] == [["taskset", "-c", "0"], ["taskset", "-c", "1"]]
    assert all(s.env["OMP_NUM_THREADS"] == "1" for s in servers) and servers[0].port != servers[1].port
    assert "--device" in servers[0].command and logs[0] != logs[1]


def test_router_command_is_round_robin_without_retries() -> None:
    cmd = router.router_command(["http://127.0.0.1:1", "http://127.0.0.1:2"], 3000, 3001)
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    assert cmd[cmd.index("--policy") + 1] == "round_robin"
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == ["http://127.0.0.1:1",
                                                                                   "http://127.0.0.1:2"]
    assert "--disable-retries" in cmd and cmd[cmd.index("--port") + 1] == "3000"


def test_client_round_robin_alternates_instances() -> None:
    front = router.Frontend(["a", "b"], None, "reason")
    assert [front.target() for _ in range(3)] == [("a", 0), ("b", 1), ("a", 0)]
    assert front.record()["kind"] == "client-round-robin" and front.record()["reason"] == "reason"


# -- who served what ------------------------------------------------------------------------------


def test_round_robin_alternates_turns_only_with_an_odd_number_of_conversations() -> None:
    assert sharing.alternates(3) and not sharing.alternates(4)
    w = wl(3, 3)
    a = sharing.predicted_workers(w)
    assert all(a[f"c{c}-r{r}"] != a[f"c{c}-r{r + 1}"] for c in range(3) for r in (1, 2))
    even = sharing.predicted_workers(wl(2, 3))
    assert even["c0-r1"] == even["c0-r2"]


def test_ideal_cached_tokens_favour_the_shared_store() -> None:
    w = wl(3, 3)
    ideal = sharing.ideal_cached_tokens(w, 16, sharing.predicted_workers(w))
    # Shared: each measured turn finds its whole previous prompt (96, then 144 tokens); per instance only the
    # system prompt on turn 2 and the turn-1 prompt on turn 3.
    assert ideal == {"shared": 3 * (96 + 144), "per_instance": 3 * (64 + 96)}
    per = sharing.per_worker_unique_tokens(w, 16, sharing.predicted_workers(w))
    assert len(per) == 2 and all(n > 0 for n in per)


def test_request_logs_attribute_requests_and_alternation_counts_switches(tmp_path: Path) -> None:
    for i, rids in enumerate((["x-c0-r1", "x-c0-r3"], ["x-c0-r2"])):
        d = tmp_path / f"w{i}"
        d.mkdir()
        lines = [f'[2026-01-01 00:00:00] {json.dumps({"event": "request.received", "rid": r})}' for r in rids]
        (d / "host_0.log").write_text("\n".join([*lines, "not json"]) + "\n")
    served = [sharing.parse_request_log(tmp_path / f"w{i}") for i in range(2)]
    assert served == [{"x-c0-r1", "x-c0-r3"}, {"x-c0-r2"}]
    phases = [{"phase": r - 1, "requests": [{"group": "c0", "sent_rid": f"x-c0-r{r}", "meta_id": f"x-c0-r{r}"}]}
              for r in (1, 2, 3)]
    phases[2]["requests"].append({"group": "c1", "sent_rid": "y", "via_instance": 1})
    sharing.attribute([r for p in phases for r in p["requests"]], served)
    assert [p["requests"][0]["worker"] for p in phases] == [0, 1, 0]
    assert phases[2]["requests"][1]["worker"] == 1  # sent directly by the client
    alt = sharing.alternation(phases)
    assert (alt["switched"], alt["transitions"], alt["fraction"]) == (2, 2, 1.0)
    assert alt["requests_per_worker"] == {"0": 2, "1": 2}


# -- report ---------------------------------------------------------------------------------------


def phase(ttfts: list[float], cached: int, storage: int, measured: bool = True) -> dict[str, Any]:
    reqs = [{"rid": f"r{i}", "group": f"c{i}", "ttft_s": t, "latency_s": t + 0.1, "prompt_tokens": 1000,
             "cached_tokens": cached, "cached_device": cached - storage, "cached_host": 0, "cached_storage": storage,
             "worker": i % 2} for i, t in enumerate(ttfts)]
    return {"phase": 1, "measured": measured, "wall_s": 10.0, "requests": reqs,
            "metrics_delta": {"prefetched_tokens": storage * len(ttfts), "backuped_tokens": 100.0},
            "cpu": {"server_s": 5.0, "machine_busy_s": 8.0}}


def synthetic(shared_ttft: float, shared_cached: int, file_ttft: float) -> dict[str, Any]:
    cells = {"radix": ([3.0, 3.2, 3.1], 64, 0), "kvtier-per-instance": ([2.0, 2.2, 2.1], 400, 300),
             "file-shared": ([file_ttft] * 3, shared_cached, shared_cached - 64),
             "kvtier-shared": ([shared_ttft] * 3, shared_cached, shared_cached - 64)}
    run: dict[str, Any] = {
        "started": "20260101-000000", "gpu": False, "concurrency": 4, "pinning_words": "1 CPU",
        "model": {"name": "bench", "kv_bytes_per_token": 16384, "dtype": "bfloat16", "dtype_source": "auto"},
        "machine": {}, "page_cache": {"policy": "dropped"},
        "sizing": {"page_size": 16, "device_tokens": 3136, "host_tokens": 6272, "per_worker_unique_tokens": [9000, 9000],
                   "ideal_cached": {"shared": 900, "per_instance": 500}},
        "workload_info": {"description": "3 clients x 3 rounds"}, "config_order": list(cells), "configs": {},
    }
    for name, (ttfts, cached, storage) in cells.items():
        phases = [phase([9.0] * 3, 0, 0, measured=False), phase(ttfts, cached, storage)]
        run["configs"][name] = {"summary": sharing_report.summarize(phases, 16384), "l3_where": "x",
                                "frontend": {"kind": "router"}, "alternation": sharing.alternation(phases),
                                "instances": [{"index": 0, "command_str": "python -m sglang.launch_server"}]}
    return run


def test_ratios_and_targets_on_a_run_that_meets_them() -> None:
    run = synthetic(shared_ttft=1.0, shared_cached=800, file_ttft=1.5)
    r = sharing_report.ratios(run)
    assert r["cached_shared_vs_per_instance"] == pytest.approx(2.0)
    assert r["ttft_p50_cut_vs_per_instance"] == pytest.approx(1 - 1.0 / 2.1)
    assert r["ttft_p50_file_over_shared"] == pytest.approx(1.5)
    assert [t["met"] for t in sharing_report.targets(run)] == [True, True, True]
    s = run["configs"]["kvtier-shared"]["summary"]
    assert s["cached_total"] == 2400 and s["cached_tokens"]["storage"] == 3 * 736 and s["requests"] == 3


def test_targets_fail_and_missing_configurations_are_not_measured() -> None:
    run = synthetic(shared_ttft=1.9, shared_cached=500, file_ttft=1.8)
    assert [t["met"] for t in sharing_report.targets(run)] == [False, False, False]
    del run["configs"]["file-shared"]
    run["configs"]["kvtier-per-instance"] = {"error": "boom", "l3_where": "x"}
    assert [t["met"] for t in sharing_report.targets(run)] == [None, None, None]
    md = sharing_report.markdown(run)
    assert "not measured" in md and "FAILED" in md


def test_markdown_table_and_png(tmp_path: Path) -> None:
    run = synthetic(shared_ttft=1.0, shared_cached=800, file_ttft=1.5)
    md = sharing_report.markdown(run)
    assert "| kvtier-shared | x | router | 3 | 3,000 | 2,400 | 2,208 | 80% | 1.00 |" in md
    assert md.count("**MET**") == 3 and "2.00x" in md and "52%" in md
    assert "| radix |" in md and "turns switched" in md and "| 5 | 3 |" in md  # server, others' CPU s
    (png,) = sharing_report.plots(run, tmp_path)
    assert png.name == "sharing.png" and png.read_bytes()[:4] == b"\x89PNG"
