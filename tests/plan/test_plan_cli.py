"""sgl-kvtier plan from the command line: files written, figures read from a bench_store result or a
server's /metrics text, and bad input named by its field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_kvtier.cli import main

MODEL = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
         "hidden_size": 512, "intermediate_size": 1024, "torch_dtype": "bfloat16"}


def args(trace: Path, tmp_path: Path, *more: str) -> list[str]:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(MODEL))
    return ["plan", "--trace", str(trace), "--model", str(tmp_path / "model"), "--instances", "2",
            "--hbm-kv-gb", "0.004", "--host-kv-gb", "0.008", "--l3-sizes", "0.02G", "50M", *more]


def test_writes_the_plan(mooncake_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(args(mooncake_trace, tmp_path, "--read-gbps", "5", "--prefill", "1e-4,1e-6", "--out", str(out))) == 0
    printed = capsys.readouterr().out
    record = json.loads((out / "plan.json").read_text())
    assert record["model"]["pool_bytes_per_token"] == 4 * 2 * 2 * 64 * 2
    assert [r["name"] for r in record["rows"]][3:] == ["L3 20 MB shared", "L3 20 MB per instance",
                                                        "L3 50 MB shared", "L3 50 MB per instance"]
    assert record["advice"] in printed.replace("\n", " ") or record["advice"][:40] in printed
    assert record["prefill_from"] == "given: 1e-4,1e-6" and record["array"]["read_Bps"] == 5e9
    assert "| configuration |" in (out / "plan.md").read_text()
    if (out / "plan.png").exists():
        assert (out / "plan.png").stat().st_size > 1000


def test_measured_store_figures_and_server_metrics(mooncake_trace: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # bench_store's rows (its JSON's "rows": metric, value) for 0.125 and 2 MiB pages
    rows = [{"metric": "kvtier[threads] get cold 0.125 MiB", "value": 1.5},
            {"metric": "kvtier[threads] put 0.125 MiB", "value": 0.8},
            {"metric": "kvtier[threads] get 64 pages latency 0.125 MiB", "value": 10.0},
            {"metric": "kvtier[threads] get cold 2 MiB", "value": 3.0}]
    (tmp_path / "bs.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "metrics.txt").write_text(
        "# HELP kvtier_prefill_per_token_seconds Prefill model: seconds per new token\n"
        'kvtier_prefill_per_token_seconds{rank="0",tp="1"} 0.0002\n'
        'kvtier_prefill_per_token_kctx_seconds{rank="0",tp="1"} 1e-06\n'
        'kvtier_prefill_fixed_seconds{rank="0",tp="1"} 0.01\n'
        'kvtier_prefill_samples{rank="0",tp="1"} 40\n')
    code = main(args(mooncake_trace, tmp_path, "--measured", str(tmp_path / "bs.json"), "--prefill-metrics",
                     str(tmp_path / "metrics.txt"), "--json"))
    assert code == 0
    record = json.loads(capsys.readouterr().out)
    # 64 tokens x 2 KiB = 128 KiB pages: the 0.125 MiB rows
    assert record["array"]["read_Bps"] == 1.5e9 and record["array"]["write_Bps"] == 0.8e9
    assert record["array"]["batch_latency_s"] == pytest.approx(0.010 - 64 * 2**17 / 1.5e9)
    assert record["deployment"]["prefill"] == {"per_token_s": 2e-4, "per_token_kctx_s": 1e-6, "fixed_s": 0.01}


@pytest.mark.parametrize(("more", "field"), [
    (["--read-gbps", "5", "--prefill", "1e-4,1e-6", "--l3-sizes", "lots"], "l3_sizes"),
    (["--read-gbps", "5"], "prefill"),
    (["--read-gbps", "5", "--prefill", "1e-4"], "prefill"),
    (["--prefill", "1e-4,0"], "read_gbps"),
    (["--read-gbps", "5", "--gpu-tflops", "100", "--mfu", "2"], "mfu"),
    (["--read-gbps", "5", "--prefill", "1e-4,0", "--instances", "0"], "instances"),
    (["--read-gbps", "5", "--prefill-metrics", "/nonexistent/metrics"], "prefill_metrics"),
])
def test_bad_input_names_the_field(mooncake_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   more: list[str], field: str) -> None:
    argv = args(mooncake_trace, tmp_path, *more)
    if "lots" in more:  # replace the sizes
        i = argv.index("--l3-sizes")
        argv[i:i + 3] = []
    assert main(argv) == 1
    assert f"error: {field}:" in capsys.readouterr().out.replace("\n", " ")
