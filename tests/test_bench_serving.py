"""benchmarks.bench_serving: pure parts (workloads, flags, report) and a smoke run on real servers.

The smoke run starts two real SGLang servers on the CPU (tiny model): `radix` and `kvtier-l3`, each
serving 2 clients x 2 rounds at concurrency 1. It uses `--flush-between-phases`, so round 2 finds L1
and L2 empty and the kvtier server must take the round-1 prefix from L3; the harness waits for every
round-1 page to be backed up before it flushes. About two minutes: two start-ups dominate.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import threading
import time
from pathlib import Path

import pytest

from benchmarks import bench_serving as bench
from benchmarks.common import TRACE
from benchmarks.serving import configs, probes, report, workloads
from benchmarks.serving.models import kv_dtype_bytes
from sgl_kvtier.serving import client, summary
from sgl_kvtier.serving import model_factory as mf
from sgl_kvtier.serving.hardware import ENV_DTYPE, native_dtype


def src(salt: int = 0) -> workloads.TokenSource:
    return workloads.TokenSource(3, 1024, salt)


# -- workloads ------------------------------------------------------------------------------------


def test_thread_cpu_counts_our_named_threads_by_pool() -> None:
    """A thread named like an IO worker burns 0.2 s of CPU: its pool's group grows by that much while it
    lives, and once it ended the process's ``(ended threads)`` group holds it instead."""
    import psutil

    from sgl_kvtier.io.threads import name_this_thread

    assert probes.thread_group("sglang::scheduler", "kvtier-parts_12") == "kvtier-parts"
    assert probes.thread_group("sglang::scheduler", "kvtier-lease") == "kvtier-lease"
    assert probes.thread_group("sglang::scheduler", "python") == "sglang::scheduler"
    me = psutil.Process().name()
    burnt, done = threading.Event(), threading.Event()

    def burn() -> None:
        name_this_thread("kvtier-io_7")
        start = time.thread_time()
        while time.thread_time() - start < 0.2:
            pass
        burnt.set()
        done.wait(60)

    before = probes.thread_cpu(os.getpid())
    t = threading.Thread(target=burn)
    t.start()
    assert burnt.wait(60)
    during = probes.thread_cpu(os.getpid())
    done.set()
    t.join()
    after = probes.thread_cpu(os.getpid())
    assert during["kvtier-io"] - before.get("kvtier-io", 0.0) >= 0.15  # clock ticks: 10 ms resolution
    assert "kvtier-io" not in after or after["kvtier-io"] < during["kvtier-io"]
    ended = f"{me} (ended threads)"
    assert after[ended] - during[ended] >= 0.15


def test_multiturn_rounds_extend_the_previous_round() -> None:
    wl = workloads.multiturn(src(), clients=3, rounds=3, system_tokens=64, user_tokens=32, answer_tokens=16,
                             max_new_tokens=4)
    assert [len(p) for p in wl.phases] == [3, 3, 3]
    for c in range(3):
        r1, r2, r3 = (wl.phases[r][c] for r in range(3))
        assert len(r1.tokens) == 64 + 32 and len(r2.tokens) == 64 + 2 * 32 + 16
        assert r2.tokens[: len(r1.tokens)] == r1.tokens and r3.tokens[: len(r2.tokens)] == r2.tokens
    heads = {tuple(wl.phases[0][c].tokens[:64]) for c in range(3)}
    assert len(heads) == 1  # one shared system prompt
    assert wl.phases[0][0].tokens[64:] != wl.phases[0][1].tokens[64:]
    # Cumulative unique whole pages: system prompt once, then each client's own tokens.
    assert wl.unique_tokens(16) == [64 + 3 * 32, 64 + 3 * (2 * 32 + 16), 64 + 3 * (3 * 32 + 2 * 16)]


def test_salt_changes_every_token_block_and_same_salt_repeats() -> None:
    a, b = src(0), src(1)
    assert a.block("sys", 50) == src(0).block("sys", 50)
    assert a.block("sys", 50) != b.block("sys", 50)
    assert all(3 <= t < 1024 for t in a.block("x", 500))


def test_docqa_interleaves_documents_after_one_warm_up_question_each() -> None:
    wl = workloads.docqa(src(), documents=3, doc_tokens=100, questions=3, question_tokens=8, max_new_tokens=4)
    assert [r.rid for r in wl.phases[0]] == ["d0-q0", "d1-q0", "d2-q0"]
    assert [r.group for r in wl.phases[1]] == ["d0", "d1", "d2", "d0", "d1", "d2"]
    assert wl.phases[1][0].tokens[:100] == wl.phases[0][0].tokens[:100]


@pytest.mark.skipif(not TRACE.exists(), reason="the Mooncake trace is not on this machine")
def test_trace_keeps_the_reuse_structure_of_hash_ids() -> None:
    rows = workloads.load_trace(TRACE)
    wl = workloads.trace(src(), rows, requests=30, block_tokens=8, max_tokens=400, max_new_tokens=4,
                         time_scale=0.0, warmup_fraction=0.5)
    reqs = wl.requests
    assert len(reqs) >= 30 and all(r.arrival_s is None for r in reqs)
    by_rid = {r.rid: r for r in reqs}
    for r in reqs:
        row = rows[int(r.rid[3:])]
        want = min(-(-row["input_length"] * 8 // 512), len(row["hash_ids"]) * 8, 400)
        assert len(r.tokens) == want
        # Equal hash ids at the same position give equal token blocks.
        for other in reqs:
            orow = rows[int(other.rid[3:])]
            shared = 0
            while shared < min(len(row["hash_ids"]), len(orow["hash_ids"])) and \
                    row["hash_ids"][shared] == orow["hash_ids"][shared]:
                shared += 1
            n = min(shared * 8, len(r.tokens), len(other.tokens))
            assert by_rid[r.rid].tokens[:n] == other.tokens[:n]
    # Every selected conversation has at least two requests, so later ones reuse earlier prefixes.
    groups = {r.group for r in reqs}
    assert all(sum(r.group == g for r in reqs) >= 2 for g in groups)
    assert wl.unique_tokens(8)[-1] < sum(len(r.tokens) for r in reqs)
    timed = workloads.trace(src(), rows, requests=30, block_tokens=8, max_tokens=400, max_new_tokens=4,
                            time_scale=0.01, warmup_fraction=0.5)
    for phase in timed.phases:
        assert phase[0].arrival_s == 0.0
        assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(phase))


# -- configurations --------------------------------------------------------------------------------


def test_configuration_flags(tmp_path: Path) -> None:
    plan = configs.ServerPlan(page_size=16, device_tokens=4096, host_ratio=1.5, host_size_gb=0, gpu=False,
                              l3_root=tmp_path, kvtier_capacity_bytes=10**9)
    cfgs = configs.resolve(["e", "recompute", "b,c", "file-l3"])
    assert [c.name for c in cfgs] == ["recompute", "radix", "hicache-dram", "file-l3", "kvtier-l3"]
    args = {c.name: c.args(plan) for c in cfgs}
    for a in args.values():
        assert a[:4] == ["--page-size", "16", "--max-total-tokens", "4096"]
        assert "--enable-cache-report" in a and "--enable-metrics" in a
    assert "--disable-radix-cache" in args["recompute"]
    assert "--enable-hierarchical-cache" not in args["radix"]
    assert "--hicache-storage-backend" not in args["hicache-dram"]
    for name in ("hicache-dram", "file-l3", "kvtier-l3"):
        a = args[name]
        assert a[a.index("--hicache-ratio") + 1] == "1.5"
        assert a[a.index("--hicache-io-backend") + 1] == "direct" and a[a.index("--hicache-mem-layout") + 1] == "layer_first"
    f = args["file-l3"]
    assert f[f.index("--hicache-storage-backend") + 1] == "file"
    assert json.loads(f[f.index("--hicache-storage-backend-extra-config") + 1]) == {
        "file_storage_path": str(tmp_path / "file-l3")}
    k = args["kvtier-l3"]
    assert k[k.index("--hicache-storage-backend") + 1] == "dynamic"
    extra = json.loads(k[k.index("--hicache-storage-backend-extra-config") + 1])
    assert extra["class_name"] == "KVTierStorage" and extra["devices"] == [str(tmp_path / "kvtier-l3")]
    tuned = dataclasses.replace(plan, kvtier_extra={"io_depth": 4})
    k = configs.CONFIGS["e"].args(tuned)
    assert json.loads(k[k.index("--hicache-storage-backend-extra-config") + 1])["io_depth"] == 4
    gpu = configs.ServerPlan(page_size=64, device_tokens=10**6, host_ratio=2, host_size_gb=100, gpu=True,
                             l3_root=tmp_path, kvtier_capacity_bytes=10**9)
    g = configs.CONFIGS["e"].args(gpu)
    assert "--hicache-io-backend" not in g and g[g.index("--hicache-size") + 1] == "100"
    with pytest.raises(ValueError):
        configs.resolve(["z"])


def test_pool_sizing_and_kv_bytes(tmp_path: Path) -> None:
    assert configs.size_device_pool(1000, 16, 1.25) == 1264
    assert configs.size_device_pool(1000, 16, 1.0) == 1024  # at least one page more than the longest request
    assert configs.host_ratio_for(2176, 4 * 1736) == 3.2 and configs.host_ratio_for(2176, 1736) == 2.0
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8, "hidden_size": 1024,
         "vocab_size": 1024}))
    assert configs.kv_bytes_per_token(tmp_path) == 8 * 8 * 64 * 2 * 2
    for dtype in ("bfloat16", "float32"):  # the benchmarks read kvheavy's 128 KiB per token in either dtype
        (tmp_path / "config.json").write_text(json.dumps(mf._hf_config(mf.spec_for("kvheavy", dtype), dtype, 1, 0)))
        assert configs.kv_bytes_per_token(tmp_path, kv_dtype_bytes(dtype)) == 131072
    assert workloads.token_range(tmp_path) == (3, 1024)


def test_the_first_token_is_the_first_chunk_with_output() -> None:
    """SGLang streams an empty chunk when it retracts a request (seen on a real server: output_ids [],
    completion_tokens 0, 0.06 s in, before the first token): it is not the first token."""
    assert not client.carries_tokens({"text": "", "output_ids": [], "meta_info": {"completion_tokens": 0}})
    assert client.carries_tokens({"text": " kome", "output_ids": [1005], "meta_info": {"completion_tokens": 1}})
    assert client.carries_tokens({"text": "x", "meta_info": {"completion_tokens": 1}})  # no ids: the count says
    assert not client.carries_tokens({"text": "", "meta_info": {}}) and client.carries_tokens({"text": "a"})


def test_phases_cut_the_ttft_at_sglangs_stamps() -> None:
    meta = {"request_received_ts": 100.01, "queue_time": 0.5, "storage_prefetch_wait": 0.3,
            "forward_entry_time": 100.6, "prefill_finished_time": 101.4}
    got = client.phases_of(meta, sent_at=100.0, ttft_s=1.5)
    assert got == pytest.approx({"received_s": 0.1, "prefetch_wait_s": 0.3, "queued_s": 0.2, "forward_s": 0.8,
                                 "returned_s": 0.1})
    assert sum(got.values()) == pytest.approx(1.5) and tuple(got) == client.PHASES
    assert client.phases_of({**meta, "storage_prefetch_wait": None}, 100.0, 1.5)["queued_s"] == pytest.approx(0.5)
    assert client.phases_of({k: v for k, v in meta.items() if k != "forward_entry_time"}, 100.0, 1.5) is None
    recs = [{"phases": got}, {"phases": {k: 3 * v for k, v in got.items()}}, {"phases": got}, {}]
    assert summary.phase_medians(recs) == pytest.approx(got) and summary.phase_medians([{}]) == {}


def test_metrics_parsing() -> None:
    text = [
        ("sglang:cached_tokens_total", {"cache_source": "storage", "tp_rank": "0"}, 5.0),
        ("sglang:cached_tokens_total", {"cache_source": "storage", "tp_rank": "1"}, 2.0),
        ("sglang:cached_tokens_total", {"cache_source": "device"}, 7.0),
        ("sglang:prefetched_tokens_total", {}, 3.0),
    ]
    got = client.counters(text)
    assert got["cached_storage"] == 7.0 and got["cached_device"] == 7.0 and got["prefetched_tokens"] == 3.0
    assert client.delta({"a": 5.0}, {"a": 2.0}) == {"a": 3.0}


# -- report ----------------------------------------------------------------------------------------


def _fake_run() -> dict:
    def level(c: int, ttft: float, storage: int) -> dict:
        reqs = [{"rid": f"r{i}", "ttft_s": ttft * (1 + i / 10), "latency_s": ttft * 2, "prompt_tokens": 1000,
                 "cached_device": 100, "cached_host": 0, "cached_storage": storage} for i in range(5)]
        phases = [{"measured": False, "wall_s": 1.0, "requests": reqs, "metrics_delta": {"backuped_tokens": 50.0}},
                  {"measured": True, "wall_s": 2.0, "requests": reqs,
                   "metrics_delta": {"prefetched_tokens": 500.0, "backuped_tokens": 100.0}}]
        return {"concurrency": c, "summary": summary.summarize(phases, 1000)}

    cfgs = {"recompute": 4.0, "radix": 3.0, "file-l3": 1.5, "kvtier-l3": 1.0}
    return {
        "started": "now", "gpu": False, "model": {"name": "bench", "kv_bytes_per_token": 1000},
        "sizing": {"page_size": 16, "device_tokens": 100, "host_tokens": 100}, "page_cache": {"policy": "dropped"},
        "workloads": ["multiturn"], "workload_info": {"multiturn": {"description": "d",
                                                                    "unique_prefix_tokens_cumulative": [1, 2]}},
        "config_order": list(cfgs),
        "configs": {n: {"summary": n, "command_str": "python -m sglang.launch_server", "startup_s": 40.0,
                        "workloads": {"multiturn": [level(c, t * c / 4, 500 if "l3" in n else 0) for c in (4, 8)]}}
                    for n, t in cfgs.items()},
    }


def test_summary_report_and_plots(tmp_path: Path) -> None:
    run = _fake_run()
    s = run["configs"]["kvtier-l3"]["workloads"]["multiturn"][0]["summary"]
    assert s["requests"] == 5 and s["req_per_s"] == 2.5 and s["input_tok_per_s"] == 2500
    assert s["cached_tokens"] == {"device": 500, "host": 0, "storage": 2500} and s["computed_tokens"] == 2000
    assert s["l3_read_gb"] == pytest.approx(500 * 1000 / 1e9) and s["l3_written_gb_incl_warmup"] > s["l3_written_gb"]
    md = report.markdown(run)
    row = next(line for line in md.splitlines() if line.startswith("| kvtier-l3 | 4 |"))
    assert row.endswith("| 3.00x | 4.00x | 1.50x |")  # vs radix, recompute, file-l3
    assert "MET" in md and "NOT MET" not in md
    paths = report.plots(run, tmp_path)
    assert [p.name for p in paths] == ["ttft_vs_concurrency.png", "hit_tokens_by_tier.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_repetitions_pool_their_requests() -> None:
    run = {"configs": {}}
    cfg = configs.CONFIGS["b"]

    def res(rep: int, ttft: float) -> dict:
        reqs = [{"rid": f"r{i}", "ttft_s": ttft, "latency_s": ttft, "prompt_tokens": 10, "cached_device": 0,
                 "cached_host": 0, "cached_storage": 0} for i in range(3)]
        phases = [{"measured": True, "wall_s": 1.0, "requests": reqs, "metrics_delta": {}, "repeat": rep}]
        return {"command": ["x"], "command_str": "x", "startup_s": 1.0 + rep, "log": f"l{rep}", "repeat": rep,
                "workloads": {"multiturn": [{"concurrency": 4, "salt": 0, "phases": phases,
                                             "summary": summary.summarize(phases, 1)}]}}

    bench.merge(run, cfg, res(0, 1.0), 1)
    bench.merge(run, cfg, res(1, 3.0), 1)
    entry = run["configs"]["radix"]
    assert [r["startup_s"] for r in entry["runs"]] == [1.0, 2.0] and entry["startup_s"] == 1.0
    (level,) = entry["workloads"]["multiturn"]
    assert len(level["phases"]) == 2 and level["summary"]["requests"] == 6
    assert level["summary"]["ttft_p50_by_repeat"] == [1.0, 3.0] and level["summary"]["req_per_s"] == 3.0


# -- the smoke run ---------------------------------------------------------------------------------


@pytest.mark.server
def test_smoke_run_two_configurations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sglang")
    monkeypatch.delenv(ENV_DTYPE, raising=False)
    model = mf.make_model(tmp_path / "model", "tiny")
    out = tmp_path / "out"
    rc = bench.main([
        "--model", str(model), "--configs", "radix", "kvtier-l3", "--workload", "multiturn", "--concurrency", "1",
        "--clients", "2", "--rounds", "2", "--system-tokens", "256", "--user-tokens", "128", "--answer-tokens", "32",
        "--max-new-tokens", "4", "--flush-between-phases", "--no-drop-caches", "--no-progress", "--cpu",
        "--kvtier-capacity-gb", "0.25", "--out", str(out),
    ])  # fmt: skip
    assert rc == 0
    for name in ("results.json", "report.md", "ttft_vs_concurrency.png", "hit_tokens_by_tier.png"):
        assert (out / name).stat().st_size > 0, name
    run = json.loads((out / "results.json").read_text())
    assert list(run["configs"]) == ["radix", "kvtier-l3"]
    for cfg in run["configs"].values():
        assert "error" not in cfg, cfg.get("error")
        assert cfg["command"][1:3] == ["-m", "sglang.launch_server"] and cfg["startup_s"] > 0
        (level,) = cfg["workloads"]["multiturn"]
        assert [len(p["requests"]) for p in level["phases"]] == [2, 2]
        for phase in level["phases"]:
            for rec in phase["requests"]:
                assert "error" not in rec and rec["ttft_s"] > 0 and rec["prompt_tokens"] in (384, 544), rec
        assert level["summary"]["requests"] == 2 and level["summary"]["errors"] == 0
    kv = run["configs"]["kvtier-l3"]
    assert "--hicache-storage-backend" in kv["command"] and "dynamic" in kv["command"]
    measured = kv["workloads"]["multiturn"][0]["phases"][1]
    assert measured["settle"]["flush_s"] >= 0 and measured["settle"]["backups"]["settled"]
    # After the flush, client 0's round-2 prompt finds its whole round-1 prompt (24 pages) in L3 only.
    first = measured["requests"][0]
    assert first["rid"] == "c0-r2" and first["cached_storage"] == 384 and first["cached_device"] == 0, first
    assert measured["metrics_delta"]["cached_storage"] >= 384 and measured["metrics_delta"]["prefetched_tokens"] >= 384
    (kv_run,) = kv["runs"]
    assert kv_run["l3_store"]["shards"][0]["pages"] > 0 and kv_run["log"].endswith("kvtier-l3.log")
    radix = run["configs"]["radix"]["workloads"]["multiturn"][0]["summary"]
    assert radix["cached_tokens"]["storage"] == 0
    md = (out / "report.md").read_text()
    assert "| kvtier-l3 | 1 |" in md and "| radix | 1 |" in md and "sglang.launch_server" in md
    machine = run["machine"]
    dtype = native_dtype()  # --cpu, no --dtype, no KVTIER_MODEL_DTYPE: the CPU's native dtype, spelled out
    assert machine["model_dtype"] == dtype == run["model"]["dtype"] and machine["matmul_gflops"]["fp32"] > 0
    assert machine["model_dtype_source"].startswith("auto: CPU ") and machine["native_dtype"] == dtype
    assert kv["command"][kv["command"].index("--dtype") + 1] == dtype
    assert f"Machine: {machine['cpu_model']}" in md and f"model dtype {dtype} (auto: CPU " in md
