"""benchmarks.bench_policy: policies, device settings, the prefix-round workload, the report, and a smoke
run on real servers.

The smoke run (`--smoke`) starts two real SGLang servers on the CPU (tiny model, HiCache + sgl-kvtier L3 on a
throttled 2 MB/s device): `load-all` and `cost`, each serving a write round, a prime round and one measured
round of 2 requests, with L1 + L2 flushed before every round after the write round. About 1.5-2 minutes:
two start-ups dominate.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks import bench_policy as bench
from benchmarks.serving import configs, policy_report, workloads
from benchmarks.serving.policies import (
    POLICIES,
    parse_device,
    prefix_rounds,
    resolve_policies,
    unique_tokens,
)
from sgl_kvtier.serving import summary


def test_device_settings() -> None:
    assert parse_device("fast", 2.0).throttle is None and parse_device("fast", 2.0).kvtier_extra() == {}
    slow = parse_device("slow:50", 3.0)
    assert slow.name == "slow-50MBps"
    assert slow.throttle == {"read_bytes_per_s": 50e6, "write_bytes_per_s": 50e6, "latency_s": 0.003}
    assert slow.kvtier_extra()["slow_io_s"] >= 600  # the breaker must not take a slow device for a dead one
    asym = parse_device("slow:50:200", 0)
    assert asym.name == "slow-50MBps-w200" and asym.throttle["write_bytes_per_s"] == 200e6
    for bad in ("slow", "slow:0", "slow:x", "medium:5", "slow:1:2:3"):
        with pytest.raises(ValueError):
            parse_device(bad, 0)


def test_policies_differ_only_in_the_prefetch_decision(tmp_path: Path) -> None:
    assert [p.name for p in resolve_policies(["cost", "recompute"])] == ["recompute", "cost"]
    with pytest.raises(ValueError):
        resolve_policies(["never"])
    plan = configs.ServerPlan(page_size=16, device_tokens=4096, host_ratio=2, host_size_gb=0, gpu=False,
                              l3_root=tmp_path, kvtier_capacity_bytes=10**9)
    args = {}
    for p in POLICIES.values():
        extra = {**dict(p.kvtier_extra), **parse_device("slow:4", 2).kvtier_extra()}
        args[p.name] = bench.KVTIER.args(dataclasses.replace(plan, extra_args=p.server_args, kvtier_extra=extra))
    for name, a in args.items():
        assert a[a.index("--hicache-storage-backend") + 1] == "dynamic"
        policy = a[a.index("--hicache-storage-prefetch-policy") + 1]
        assert policy == ("wait_complete" if name == "load-all" else "timeout"), name
        cfg = json.loads(a[a.index("--hicache-storage-backend-extra-config") + 1])
        assert cfg["throttle"]["read_bytes_per_s"] == 4e6
        assert (cfg.get("prefetch_threshold", 256) > 10**6) == (name == "recompute")
    env = {p.name: dict(p.env) for p in POLICIES.values()}
    assert env["cost"] == {"KVTIER_PREFETCH_POLICY": "cost"}
    assert all(e == {"KVTIER_PREFETCH_POLICY": "off"} for n, e in env.items() if n != "cost")


def test_prefix_rounds_put_each_document_once_per_round() -> None:
    src = workloads.TokenSource(3, 1024, 0)
    rounds = prefix_rounds(src, documents=3, doc_tokens=64, question_tokens=16, concurrency=[1, 4], rounds=2,
                           prime_rounds=1, max_new_tokens=4)
    assert [(r.kind, r.concurrency) for r in rounds] == [
        ("write", 4), ("prime", 1), ("measured", 1), ("measured", 1), ("measured", 4), ("measured", 4)]
    docs = {tuple(r.tokens[:64]) for r in rounds[0].requests}
    assert len(docs) == 3
    for rnd in rounds:
        assert sorted(r.group for r in rnd.requests) == ["d0", "d1", "d2"]
        assert {tuple(r.tokens[:64]) for r in rnd.requests} == docs and all(len(r.tokens) == 80 for r in rnd.requests)
    questions = [tuple(r.tokens[64:]) for rnd in rounds for r in rnd.requests]
    assert len(set(questions)) == len(questions)  # every request computes a fresh suffix
    # Round 0 stores 3 documents + 3 questions (whole pages); each later round adds 3 question pages.
    assert unique_tokens(rounds, 16) == [240 + 48 * i for i in range(6)]


def _fake_run() -> dict:
    def cell(ttft: float, storage: int) -> dict:
        reqs = [{"rid": f"r{i}", "ttft_s": ttft * (1 + i / 10), "latency_s": ttft, "prompt_tokens": 1000,
                 "cached_device": 0, "cached_host": 0, "cached_storage": storage} for i in range(5)]
        return summary.summarize([{"measured": True, "wall_s": 2.0, "requests": reqs,
                                  "metrics_delta": {"prefetched_tokens": 5.0 * storage,
                                                    "unfulfilled_timeout": 100.0}}], 1000)

    fast = {"recompute": 4.0, "load-all": 1.0, "timeout": 1.0, "cost": 1.05}
    slow = {"recompute": 2.0, "load-all": 8.0, "timeout": 3.5, "cost": 2.5}
    return {
        "started": "now", "gpu": False, "model": {"name": "bench", "kv_bytes_per_token": 1000},
        "sizing": {"page_size": 16, "device_tokens": 100, "host_tokens": 200}, "page_cache": "dropped",
        "workload": {"description": "d"}, "device_order": ["fast", "slow-4MBps"],
        "devices": {"fast": {"description": "fast"}, "slow-4MBps": {"description": "slow"}},
        "policy_order": list(POLICIES),
        "runs": {dev: {p: {"command_str": "python -m sglang.launch_server", "env": dict(POLICIES[p].env),
                           "startup_s": 30.0, "levels": {"1": cell(t, 900 if p != "recompute" else 0)}}
                       for p, t in ttfts.items()}
                 for dev, ttfts in (("fast", fast), ("slow-4MBps", slow))},
    }  # fmt: skip


def test_report_ratios_targets_and_plot(tmp_path: Path) -> None:
    run = _fake_run()
    md = policy_report.markdown(run)
    fast_cost = next(line for line in md.split("## slow-4MBps")[0].splitlines() if line.startswith("| cost | 1 |"))
    assert "| 1.05x | 1.05x |" in fast_cost and fast_cost.endswith("| MET |")
    slow_cost = next(line for line in md.split("## slow-4MBps")[1].splitlines() if line.startswith("| cost | 1 |"))
    assert "| 1.25x | 1.25x |" in slow_cost and slow_cost.endswith("| NOT MET |")
    assert "| recompute | 1 | 2.40 | 2.79 |" in md and "KVTIER_PREFETCH_POLICY=cost python -m sglang.launch_server" in md
    lines = policy_report.targets(run)
    assert lines[0].startswith("- fast, C=1: MET") and "load-all" in lines[0]
    assert lines[1].startswith("- slow-4MBps, C=1: NOT MET") and "recompute 2.40 s" in lines[1]
    del run["runs"]["fast"]["recompute"]  # one baseline missing: judged against the other
    assert policy_report.targets(run)[0].startswith("- fast, C=1: MET")
    path = policy_report.plot(run, tmp_path)
    assert path.name == "ttft_by_policy.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoke_defaults_yield_to_explicit_flags() -> None:
    args = bench.parse_args(["--smoke", "--documents", "3"])
    assert args.model == "tiny" and args.documents == 3 and [p.name for p in args.policy_list] == ["load-all", "cost"]
    assert [d.name for d in args.device_settings] == ["slow-2MBps"]
    full = bench.parse_args([])
    assert [p.name for p in full.policy_list] == list(POLICIES) and full.devices == ["fast", "slow:4"]


@pytest.mark.server
def test_smoke_run(tmp_path: Path) -> None:
    pytest.importorskip("sglang")
    from sgl_kvtier.serving.model_factory import make_model

    model = make_model(tmp_path / "model", "tiny")
    out = tmp_path / "out"
    rc = bench.main(["--smoke", "--model", str(model), "--no-drop-caches", "--no-progress", "--cpu", "--out", str(out)])
    assert rc == 0
    for name in ("results.json", "report.md", "ttft_by_policy.png"):
        assert (out / name).stat().st_size > 0, name
    run = json.loads((out / "results.json").read_text())
    (dev,) = run["device_order"]
    assert run["devices"][dev]["throttle"]["read_bytes_per_s"] == 2e6
    assert list(run["runs"][dev]) == ["load-all", "cost"]
    for res in run["runs"][dev].values():
        assert "error" not in res, res.get("error")
        assert res["sgl_kvtier_tracebacks"] == 0 and res["env"]["KVTIER_PREFETCH_POLICY"] in ("off", "cost")
        assert [r["kind"] for r in res["rounds"]] == ["write", "prime", "measured"]
        for rnd in res["rounds"]:
            assert all("error" not in q and q["ttft_s"] > 0 and q["prompt_tokens"] == 544 for q in rnd["requests"])
            if rnd["index"]:
                assert rnd["settle"]["backups"]["settled"] and rnd["settle"]["flush_s"] >= 0
        assert res["levels"]["1"]["requests"] == 2 and res["levels"]["1"]["errors"] == 0
        assert "throttled IO" in Path(res["log"]).read_text(errors="replace")  # the slow device was emulated
    # load-all waits for every page: after the flush each document prefix (512 tokens) comes from L3.
    prime = run["runs"][dev]["load-all"]["rounds"][1]
    assert [q["cached_storage"] for q in prime["requests"]] == [512, 512]
    assert all(q["cached_device"] == 0 and q["cached_host"] == 0 for q in prime["requests"])
    md = (out / "report.md").read_text()
    assert f"## {dev}" in md and "| load-all | 1 |" in md and "| cost | 1 |" in md and "wait_complete" in md
    assert run["machine"]["cpu_flags"].keys() == {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert f"Machine: {run['machine']['cpu_model']}" in md
