"""The model/KV dtype choice: the CPU's native dtype from /proc/cpuinfo's flags, and what overrides it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_kvtier.serving import hardware as hw
from sgl_kvtier.serving.server import SGLangServer

BASE = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ssse3 sse4_1 sse4_2 avx f16c"


def cpuinfo(flags: str, cpus: int = 2) -> str:
    """A /proc/cpuinfo text of ``cpus`` identical processors with these extra flags."""
    return "".join(f"processor\t: {i}\nmodel name\t: Test CPU\nflags\t\t: {BASE} {flags}\n\n" for i in range(cpus))


AVX2_EPYC = cpuinfo("avx2 fma bmi2 sha_ni")  # Zen 2/3: AVX2 only, bf16 matmuls fall back
ZEN4 = cpuinfo("avx2 avx512f avx512bw avx512_bf16 avx512_vnni")  # AVX512-BF16, no AMX
SAPPHIRE_RAPIDS = cpuinfo("avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8")
AMX_ONLY = cpuinfo("avx2 avx512f amx_bf16 amx_tile")
SKYLAKE_SP = cpuinfo("avx2 avx512f avx512bw avx512_vnni")  # AVX512 without its BF16 extension


@pytest.mark.parametrize("text,dtype", [
    (AVX2_EPYC, "float32"), (SKYLAKE_SP, "float32"), (ZEN4, "bfloat16"), (SAPPHIRE_RAPIDS, "bfloat16"),
    (AMX_ONLY, "bfloat16"), ("", "float32"), ("processor\t: 0\nmodel name\t: no flags line\n", "float32"),
])
def test_native_dtype_follows_the_bf16_flags(text: str, dtype: str) -> None:
    assert hw.native_dtype(text) == dtype
    choice = hw.choose_dtype("auto", gpu=False, cpuinfo_text=text, env={})
    assert (choice.dtype, choice.forced) == (dtype, False)
    assert choice.describe().startswith("auto: CPU has " if dtype == "bfloat16" else "auto: CPU without ")


def test_flags_are_read_whole_words_from_the_flags_line() -> None:
    # "avx512_bf16" as part of another word, or on another line, is not the flag.
    text = "model name\t: avx512_bf16 amx_bf16 lookalike\nflags\t\t: avx2 xavx512_bf16 amx_bf16x\n"
    assert hw.cpu_flags(text) == {"avx2", "xavx512_bf16", "amx_bf16x"} and hw.native_dtype(text) == "float32"
    assert hw.native_dtype() == hw.native_dtype(Path("/proc/cpuinfo").read_text())  # the default reads this machine


def test_reasons_name_the_flags_found() -> None:
    assert hw.choose_dtype(gpu=False, cpuinfo_text=SAPPHIRE_RAPIDS, env={}).reason == "CPU has amx_bf16/avx512_bf16"
    assert hw.choose_dtype(gpu=False, cpuinfo_text=AVX2_EPYC, env={}).describe() == \
        "auto: CPU without avx512_bf16/amx_bf16"


def test_an_explicit_dtype_wins_over_the_environment_the_gpu_and_the_cpu() -> None:
    env = {hw.ENV_DTYPE: "float32"}
    for text in (AVX2_EPYC, SAPPHIRE_RAPIDS):
        for gpu in (False, True):
            assert hw.choose_dtype("bfloat16", gpu=gpu, cpuinfo_text=text, env=env) == \
                hw.DtypeChoice("bfloat16", True, "--dtype")
            assert hw.choose_dtype("float32", gpu=gpu, cpuinfo_text=text, env={}).dtype == "float32"
    assert hw.resolve_dtype("float16", gpu=False, cpuinfo_text=AVX2_EPYC) == "float16"
    forced = hw.choose_dtype("float32", gpu=False, cpuinfo_text=ZEN4, source="sglang.dtype")
    assert forced.describe() == "forced: sglang.dtype"


def test_the_environment_wins_over_auto_and_a_gpu_keeps_bf16() -> None:
    assert hw.choose_dtype(None, gpu=True, cpuinfo_text=SAPPHIRE_RAPIDS, env={hw.ENV_DTYPE: "float32"}) == \
        hw.DtypeChoice("float32", True, hw.ENV_DTYPE)
    assert hw.choose_dtype("auto", gpu=False, cpuinfo_text=AVX2_EPYC, env={hw.ENV_DTYPE: " bfloat16 "}).dtype == \
        "bfloat16"
    assert hw.choose_dtype(gpu=False, cpuinfo_text=AVX2_EPYC, env={hw.ENV_DTYPE: "auto"}).dtype == "float32"
    assert hw.choose_dtype(gpu=True, cpuinfo_text=AVX2_EPYC, env={}) == hw.DtypeChoice("bfloat16", False, "CUDA GPU")


def test_unknown_dtypes_are_refused_naming_where_they_came_from() -> None:
    with pytest.raises(ValueError, match=r"^--dtype: unknown dtype 'half'"):
        hw.choose_dtype("half", gpu=False, env={})
    with pytest.raises(ValueError, match=rf"^{hw.ENV_DTYPE}: unknown dtype 'fp8'"):
        hw.choose_dtype(gpu=False, env={hw.ENV_DTYPE: "fp8"})


def test_a_factory_model_is_served_in_its_own_dtype(tmp_path: Path) -> None:
    """SGLang's --dtype auto would serve a float32 checkpoint in float16: the runner spells the dtype out."""
    model = tmp_path / "m"
    model.mkdir()
    (model / hw.MARKER_NAME).write_text(json.dumps({"dtype": "float32", "size": "tiny"}))
    assert hw.factory_dtype(model) == "float32" and hw.dtype_args(model) == ["--dtype", "float32"]
    assert hw.dtype_args(model, ["--page-size", "16", "--dtype=bfloat16"]) == []
    assert hw.factory_dtype(tmp_path / "missing") is None and hw.dtype_args(tmp_path) == []
    cmd = SGLangServer(model, port=1, extra_args=["--page-size", "16"], cpu=True).command
    assert cmd[cmd.index("--dtype") + 1] == "float32" and cmd.count("--dtype") == 1
    cmd = SGLangServer(model, port=1, extra_args=["--dtype", "bfloat16"], cpu=True).command
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd.count("--dtype") == 1  # the caller's wins
    assert "--dtype" not in SGLangServer(tmp_path, port=1, cpu=True).command  # not a factory model
