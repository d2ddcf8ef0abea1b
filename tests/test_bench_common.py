"""benchmarks.common / benchmarks.machine, and every benchmark script starting as ``python -m benchmarks.<name>``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import REPO, args_json, median, scratch_dir, write_json
from benchmarks.machine import FLAGS, machine_info, machine_line
from benchmarks.serving.models import ServedModel, kv_dtype_bytes, resolve_model, served_dtype
from sgl_kvtier.serving.hardware import ENV_DTYPE, native_dtype

SCRIPTS = ("bench_store", "bench_backends", "bench_serving", "bench_policy", "bench_peers", "bench_plan", "reliability",
           "soak")


def test_machine_info_records_cpu_probe_and_dtype(tmp_path: Path) -> None:
    info = machine_info("float32", path=tmp_path, dtype_source="auto: CPU without avx512_bf16/amx_bf16")
    assert info["cpu_model"] and info["cores"] >= info["cores_usable"] >= 1 and info["mem_gib"] > 0
    assert info["cpu_flags"].keys() == set(FLAGS) and all(isinstance(v, bool) for v in info["cpu_flags"].values())
    import torch

    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["matmul_gflops"]["fp32"] > 0 and info["matmul_gflops"]["bf16"] > 0
    assert info["gpus"] == [] or all(g["name"] for g in info["gpus"])
    assert info["model_dtype"] == "float32" and info["fs_type"] not in ("", "?")
    assert info["native_dtype"] == native_dtype() and info["model_dtype_source"].startswith("auto: ")
    line = machine_line(info)
    assert line.startswith(info["cpu_model"]) and f"torch CPU capability {info['cpu_capability']}" in line
    assert "model dtype float32 (auto: CPU without avx512_bf16/amx_bf16)" in line and "fp32" in line and "bf16" in line
    assert f"CPU-native dtype {native_dtype()}" in line
    assert json.loads(json.dumps(info)) == info  # goes into result files as it is


def test_machine_line_without_probe_or_model() -> None:
    info = machine_info(None, probe=False)
    assert "matmul_gflops" not in info and "fs_type" not in info
    assert "model dtype none;" in machine_line(info) + ";" and "GFLOP/s" not in machine_line(info)
    assert info["model_dtype_source"] is None and "CPU-native dtype" in machine_line(info)


def test_a_model_path_is_served_in_the_chosen_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_DTYPE, raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    cpu = resolve_model(str(tmp_path))  # CPU: the native dtype, asked for with --dtype
    assert (cpu.dtype, cpu.server_args) == (native_dtype(), ("--dtype", native_dtype()))
    assert cpu.dtype_source.startswith("auto: CPU ") and served_dtype(cpu, cpu.server_args) == (cpu.dtype,
                                                                                               cpu.dtype_source)
    gpu = resolve_model(str(tmp_path), gpu=True)  # GPU: what config.json says, SGLang's --dtype auto
    assert (gpu.dtype, gpu.dtype_source, gpu.server_args) == ("bfloat16", "config.json (--dtype auto)", ())
    forced = resolve_model(str(tmp_path), "float32", gpu=True)
    assert (forced.dtype, forced.dtype_source, forced.server_args) == ("float32", "forced: --dtype",
                                                                      ("--dtype", "float32"))
    # A --server-arg after the model's own flags wins, as in SGLang's argparse.
    assert served_dtype(forced, [*forced.server_args, "--dtype=float16"]) == ("float16", "forced: --server-arg --dtype")
    assert served_dtype(gpu, ["--dtype", "auto"]) == ("bfloat16", "config.json (--server-arg --dtype auto)")
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert served_dtype(ServedModel(tmp_path, "m", "float32", "x"), ["--dtype", "auto"])[0] == "float16"
    assert kv_dtype_bytes("float32") == 4 and kv_dtype_bytes("bfloat16") == 2
    assert kv_dtype_bytes("float32", ["--kv-cache-dtype", "fp8_e4m3"]) == 1


def test_scratch_dir_removes_what_it_made(tmp_path: Path) -> None:
    parent = tmp_path / "scratch"
    with scratch_dir(parent, "run-") as root:
        assert root.parent == parent and root.name.startswith("run-")
        (root / "f").write_text("x")
    assert not parent.exists()
    parent.mkdir()
    with scratch_dir(parent, "run-") as root:
        pass
    assert parent.exists() and not root.exists()  # a parent it did not make stays


def test_results_are_json_with_paths_as_strings(tmp_path: Path) -> None:
    import argparse

    args = argparse.Namespace(dir=Path("/x"), n=3)
    out = write_json(tmp_path / "deep" / "r.json", {"args": args_json(args), "p": Path("/y")})
    assert json.loads(out.read_text()) == {"args": {"dir": "/x", "n": 3}, "p": "/y"}
    assert median([3.0, None, 1.0, 2.0]) == 2.0 and median([None]) is None


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_run_as_modules(name: str) -> None:
    if name == "bench_backends" and importlib.util.find_spec("sglang") is None:
        pytest.skip("bench_backends drives SGLang's backends")
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: ")


def test_no_script_edits_sys_path_or_imports_tests() -> None:
    test_modules = {p.stem for p in (REPO / "tests").rglob("*.py")}
    for path in (REPO / "benchmarks").rglob("*.py"):
        text = path.read_text()
        imported = {line.split()[1].split(".")[0] for line in text.splitlines() if line.startswith(("from ", "import "))}
        assert "sys.path" not in text and not imported & (test_modules | {"tests"}), path
