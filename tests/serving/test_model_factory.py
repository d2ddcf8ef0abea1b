"""The offline model factory: Qwen2 weights from numpy, written with safetensors, with no torch in-process.

SGLang loading these models is proven by the server tests (tests/sglang/test_cpu_server.py in bfloat16 and
float32); here: the files, dtypes, shapes and spec (per dtype), the dtype choice and what overrides it, the
bfloat16 rounding (against torch's, in this test process only), and that the serving tooling never imports
torch or sglang.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sgl_kvtier.serving import model_factory as mf
from sgl_kvtier.serving.hardware import DTYPE_BYTES, ENV_DTYPE, native_dtype


def header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


def test_the_pre_tokenizer_pattern_is_transformers_qwen2s():
    tokenization_qwen2 = pytest.importorskip("transformers.models.qwen2.tokenization_qwen2")
    assert mf.PRETOKENIZE_REGEX == tokenization_qwen2.PRETOKENIZE_REGEX


def test_bfloat16_bits_round_as_torch_does():
    torch = pytest.importorskip("torch")
    x = np.concatenate([np.random.default_rng(3).standard_normal(100_000, dtype=np.float32) * 3,
                        np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 65504.0, 1e-40], np.float32)])
    ours = torch.from_numpy(mf.to_bfloat16_bits(x).view(np.int16)).view(torch.bfloat16)
    assert torch.equal(ours, torch.from_numpy(x).to(torch.bfloat16))


@pytest.mark.parametrize("dtype,code", [("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16")])
def test_weights_are_written_in_the_asked_dtype(tmp_path, dtype, code):
    weights = mf.random_weights(mf.SPECS["tiny"], seed=0, pad_token_id=0)
    mf.save_safetensors(weights, tmp_path / "m.safetensors", dtype)
    head = header(tmp_path / "m.safetensors")
    assert head.pop("__metadata__") == {"format": "pt"}
    assert {k: (v["dtype"], v["shape"]) for k, v in head.items()} == {
        k: (code, list(w.shape)) for k, w in weights.items()}


def test_a_tiny_model_has_the_spec_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_DTYPE, raising=False)
    spec = mf.SPECS["tiny"]
    out = mf.make_model(tmp_path / "m", "tiny")  # dtype "auto": this machine's native dtype
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "vocab_size", "intermediate_size")} == \
        {k: getattr(spec, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                       "num_key_value_heads", "head_dim", "vocab_size", "intermediate_size")}
    dtype = native_dtype()  # no GPU in the test environment
    assert mf.DEFAULT_DTYPE == "auto" and config["dtype"] == dtype and config["model_type"] == "qwen2"
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in header(out / "model.safetensors")
    head = header(out / "model.safetensors")
    assert head["model.embed_tokens.weight"] == {**head["model.embed_tokens.weight"],
                                                 "dtype": {"bfloat16": "BF16", "float32": "F32"}[dtype],
                                                 "shape": [spec.vocab_size, spec.hidden_size]}
    marker = json.loads((out / mf.MARKER_NAME).read_text())
    assert marker["dtype"] == dtype and marker["dtype_choice"].startswith("auto: CPU ")
    assert marker["kv_bytes_per_token"] == spec.kv_bytes_per_token(DTYPE_BYTES[dtype])
    assert mf.count_tokens(out, mf.make_prompt(300, seed=4)) == 300
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert mf.make_model(out, "tiny") == out and (out / "model.safetensors").stat().st_mtime_ns == stamp  # reused
    with pytest.raises(ValueError, match="dtype"):
        mf.make_model(tmp_path / "other", "tiny", dtype="int8")


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_kvheavy_is_128_kib_of_kv_per_token_by_geometry_in_every_dtype(dtype):
    spec, base = mf.spec_for("kvheavy", dtype), mf.SPECS["kvheavy"]
    assert spec.kv_bytes_per_token(DTYPE_BYTES[dtype]) == 131072 == base.kv_bytes_per_token(2)
    # Per layer too (HiCache moves pages layer by layer): the layer count stays, the KV heads follow the dtype.
    assert spec.num_hidden_layers == 64 and spec.num_key_value_heads == 16 // DTYPE_BYTES[dtype]
    # What SGLang's CPU attention and Qwen2's GQA need: head_dim = hidden / heads, heads a multiple of KV heads.
    assert spec.head_dim * spec.num_attention_heads == spec.hidden_size
    assert spec.num_attention_heads % spec.num_key_value_heads == 0
    config = mf._hf_config(spec, dtype, eos=1, pad=0)
    assert config["dtype"] == dtype and config["num_key_value_heads"] == spec.num_key_value_heads
    for size in ("tiny", "bench"):  # these keep their geometry: float32 doubles their KV bytes per token
        assert mf.spec_for(size, dtype) == mf.SPECS[size]
    with pytest.raises(ValueError, match="dtype"):
        mf.spec_for("kvheavy", "int8")


def test_a_forced_dtype_wins_and_never_shares_a_directory(tmp_path, monkeypatch):
    from sgl_kvtier.serving.launch import factory_model

    monkeypatch.setenv(ENV_DTYPE, "float32")
    out = mf.make_model(tmp_path / "m", "tiny")  # auto, but the environment forces float32
    marker = json.loads((out / mf.MARKER_NAME).read_text())
    assert marker["dtype"] == "float32" and marker["dtype_choice"] == f"forced: {ENV_DTYPE}"
    assert marker["kv_bytes_per_token"] == 2 * 2 * 64 * 2 * 4
    assert {v["dtype"] for k, v in header(out / "model.safetensors").items() if k != "__metadata__"} == {"F32"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    # An explicit dtype wins over the environment; the float32 files are rebuilt, never served as bfloat16.
    assert mf.make_model(out, "tiny", dtype="bfloat16") == out
    assert json.loads((out / mf.MARKER_NAME).read_text())["dtype_choice"] == "forced: make_model(dtype=...)"
    assert {v["dtype"] for k, v in header(out / "model.safetensors").items() if k != "__metadata__"} == {"BF16"}
    # The model cache keeps one directory per size and dtype.
    monkeypatch.setenv("KVTIER_MODEL_CACHE", str(tmp_path / "cache"))
    forced, choice = factory_model("kvheavy", make=False, gpu=False)
    assert forced == tmp_path / "cache" / "kvheavy-float32" and choice.forced
    assert factory_model("kvheavy", "bfloat16", make=False)[0] == tmp_path / "cache" / "kvheavy-bfloat16"


def test_the_serving_tooling_imports_neither_torch_nor_sglang():
    code = ("import sys\n"
            "import sgl_kvtier.cli, sgl_kvtier.serving.demo, sgl_kvtier.serving.launch, sgl_kvtier.serving.server\n"
            "import sgl_kvtier.serving.hardware as hw\n"
            "hw.choose_dtype(gpu=False)\n"
            "import sgl_kvtier.serving.model_factory as mf\n"
            "mf.random_weights(mf.SPECS['tiny'], 0, 0)\n"
            "print(sorted(m for m in ('torch', 'sglang', 'transformers') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "[]"
