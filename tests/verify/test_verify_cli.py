"""``sgl-kvtier verify``: its checks, its workloads, and one run on real CPU servers (the L3 arm on a server the
test started, named by ``--endpoint``; the HBM-only baseline started by verify from the same config)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from sgl_kvtier.cli import build_parser, main
from sgl_kvtier.errors import ConfigError
from sgl_kvtier.serving.launch import Offload, sglang_args
from sgl_kvtier.verify.cli import check, workloads

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str):
    return build_parser().parse_args(["verify", *argv])


@pytest.mark.parametrize(("argv", "field"), [
    (["--arms", "hbm-only", "l2-only", "--config", "x.toml"], "--arms"),
    (["--arms", "l3", "--config", "x.toml"], "--arms"),
    (["--arms", "l3", "hbm-only"], "--config"),
    (["--endpoint", "l3=http://a:1", "--arms", "l2-only"], "--config"),
    (["--endpoint", "l3=http://a:1", "--endpoint", "hbm-only=http://b:1", "--baseline", "l2-only"], "--baseline"),
    (["--endpoint", "l3=a:1", "--endpoint", "hbm-only=http://b:1"], "--endpoint"),
    (["--config", "x.toml", "--concurrency", "0"], "concurrency"),
    (["--config", "x.toml", "--rounds", "1"], "rounds"),
    (["--config", "x.toml", "--warmup-fraction", "1"], "warmup_fraction"),
    (["--config", "x.toml", "--min-ttft-p50-cut", "1.2"], "gates"),
])  # fmt: skip
def test_bad_arguments_name_the_field(argv, field):
    with pytest.raises(ConfigError) as exc:
        check(parse(*argv))
    assert exc.value.field == field


def test_arms_come_from_endpoints_and_the_config_and_the_baseline_defaults_to_hbm_only():
    arms, baseline, gates = check(parse("--endpoint", "l3=http://a:1,http://b:1", "--arms", "l3", "l2-only",
                                        "hbm-only", "--config", "x.toml", "--min-throughput-gain", "0.4"))
    assert [(a.name, a.urls) for a in arms] == [("l3", ("http://a:1", "http://b:1")), ("l2-only", ()),
                                                ("hbm-only", ())]
    assert baseline == "hbm-only" and gates.throughput_gain == 0.4 and gates.ttft_p50_cut == 0.25
    _, baseline, _ = check(parse("--endpoint", "l3=http://a:1", "--endpoint", "l2-only=http://b:1", "--arms", "l3"))
    assert baseline == "l2-only"


def test_every_level_gets_its_own_prompts_and_every_arm_the_same(tmp_path):
    args = parse("--config", "x.toml", "--clients", "2", "--rounds", "2", "--system-tokens", "32",
                 "--user-tokens", "8", "--answer-tokens", "4", "--concurrency", "1", "4")
    a, b = workloads(args, (3, 500), salt=7), workloads(args, (3, 500), salt=7)
    assert [r.tokens for r in a[1].requests] == [r.tokens for r in b[1].requests]
    assert a[1].requests[0].tokens != a[4].requests[0].tokens
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 1024, "output_length": 8,
                                         "hash_ids": [0, i % 3]}) + "\n" for i in range(10)))
    args = parse("--config", "x.toml", "--trace", str(trace), "--trace-requests", "6", "--block-tokens", "16",
                 "--concurrency", "2", "--warmup-fraction", "0.5")
    wl = workloads(args, (3, 500), salt=7)[2]
    assert [len(p) for p in wl.phases] == [3, 3] and all(len(r.tokens) == 32 for r in wl.requests)
    assert wl.requests[3].tokens == wl.requests[0].tokens  # hash ids [0, 0] twice: the same prompt


@pytest.mark.server
def test_verify_on_cpu_servers_measures_both_arms_and_exits_by_its_gates(tmp_path):
    pytest.importorskip("sglang")
    from sgl_kvtier.serving.server import SGLangServer

    doc = tomllib.loads((ROOT / "configs" / "cpu-demo.toml").read_text())
    doc["kvtier"]["devices"] = [str(tmp_path / "l3")]
    doc["sglang"]["skip_server_warmup"] = True
    config = tmp_path / "verify.toml"
    config.write_text("".join(f"[{table}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in doc[table].items())
                              for table in ("sglang", "kvtier")))
    (tmp_path / "l3").mkdir()
    model, args, env = sglang_args(doc, gpu=False, offload=Offload.L3)
    out = tmp_path / "out"
    with SGLangServer(model, extra_args=args, env=env, log_path=tmp_path / "l3.log") as l3:
        code = main(["verify", "--config", str(config), "--endpoint", f"l3={l3.url}", "--arms", "l3", "hbm-only",
                     "--concurrency", "1", "2", "--clients", "2", "--rounds", "3", "--system-tokens", "256",
                     "--user-tokens", "96", "--answer-tokens", "16", "--max-new-tokens", "4",
                     "--flush-between-phases", "--out", str(out), "--no-progress"])
    run = json.loads((out / "verify.json").read_text())
    assert code == (0 if run["passed"] else 1)
    assert run["passed"] == all(v["verdict"] == "pass" for v in run["verdicts"])
    assert {(v["gate"], v["concurrency"]) for v in run["verdicts"]} == {
        (g, c) for g in ("ttft_p50_cut", "throughput_gain", "error_rate") for c in (1, 2)}
    l3_arm, base = run["arms"]["l3"], run["arms"]["hbm-only"]
    assert l3_arm["serving"]["urls"] == [l3.url] and not l3_arm["serving"]["command"]
    assert "--enable-hierarchical-cache" not in base["serving"]["command"]
    for c in ("1", "2"):
        s, b = l3_arm["levels"][c]["summary"], base["levels"][c]["summary"]
        assert s["errors"] == b["errors"] == 0 and s["requests"] == b["requests"] == 4
        assert s["cached_tokens"]["storage"] > 0  # flushed before each measured round: prefixes from flash
        assert b["cached_tokens"]["storage"] == b["cached_tokens"]["host"] == 0
        assert s["prompt_tokens"] == b["prompt_tokens"]
    same, compared = l3_arm["levels"]["1"]["same_output"]
    assert same == compared == 4  # C = 1, float32 or bf16 alike: KV from flash gives the same greedy tokens
    assert (out / "verify.md").read_text().startswith("# sgl-kvtier verify: ")
    assert (out / "verify.png").stat().st_size > 10_000
