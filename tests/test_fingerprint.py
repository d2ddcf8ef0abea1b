"""The weights' fingerprint: equal for the same bytes anywhere, different for other weights, bounded IO."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from sgl_kvtier import fingerprint as fpmod
from sgl_kvtier.fingerprint import Fingerprint, fingerprint_model, fingerprint_once, resolve_local


def tensors(seed: int, rows: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"model.layers.{i}.weight": rng.standard_normal((rows, 256)).astype(np.float32) for i in range(6)}


def write_model(root: Path, seed: int = 0, shards: int = 2) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 256}))
    (root / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (root / "tokenizer_config.json").write_text('{"bos_token": null}')
    (root / "generation_config.json").write_text('{"temperature": 0.7}')
    weights = tensors(seed)
    names = sorted(weights)
    weight_map = {}
    for s in range(shards):
        part = {n: weights[n] for n in names[s::shards]}
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(root / file))
        weight_map.update(dict.fromkeys(part, file))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def fp(path: Path | str, **kw) -> Fingerprint:
    return fingerprint_model(path, **kw)


def test_a_byte_identical_copy_elsewhere_has_the_same_fingerprint(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a" / "Qwen")
    b = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(a, b)
    os.utime(b / "config.json", (1, 1))  # mtimes are not identity
    first = fp(a)
    assert first == fp(b) and first.source == "files" and first.weights_known and first.weight_files == 2
    assert len(first.value) == 32 and int(first.value, 16) >= 0
    assert fp(a, settings={"revision": None}) == first  # unknown settings are left out


def test_same_shapes_other_values_differ_even_in_one_middle_tensor(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a", seed=0)
    assert fp(a) != fp(write_model(tmp_path / "b", seed=1))  # a same-size fine-tune
    # One tensor changed in the middle of a shard, beyond its first and last 64 KiB: the per-tensor sample.
    c = tmp_path / "c"
    shutil.copytree(a, c)
    shard = c / "model-00001-of-00002.safetensors"
    from safetensors.numpy import load_file
    part = load_file(str(shard))
    middle = sorted(part)[1]
    part[middle] = part[middle] + 1.0
    save_file(part, str(shard))
    assert shard.stat().st_size == (a / shard.name).stat().st_size
    assert shard.stat().st_size > 3 * fpmod.EDGE_BYTES
    assert fp(c) != fp(a)


@pytest.mark.parametrize("change", ["config", "tokenizer", "tokenizer_model", "index", "extra_shard", "settings"])
def test_every_hashed_part_changes_it(tmp_path: Path, change: str) -> None:
    a = write_model(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    settings: dict[str, object] = {}
    if change == "config":
        (b / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 257}))
    elif change == "tokenizer":
        (b / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    elif change == "tokenizer_model":
        (b / "tokenizer.model").write_bytes(b"sentencepiece")
    elif change == "index":
        (b / "model.safetensors.index.json").write_text("{}")
    elif change == "extra_shard":
        save_file({"x": np.zeros(4, np.float32)}, str(b / "extra.safetensors"))
    else:
        settings = {"quantization": "fp8"}
    assert fp(b, settings=settings) != fp(a)


def test_what_does_not_touch_the_kv_is_not_hashed(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    (b / "generation_config.json").write_text('{"temperature": 0.1}')
    (b / "README.md").write_text("other words")
    assert fp(b) == fp(a)


def test_a_separate_tokenizer_directory_is_read(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {"vocab": {"z": 0}}}')
    assert fp(a, tokenizer_path=tok) != fp(a)
    assert fp(a, tokenizer_path=tmp_path / "missing") == fp(a)  # not local: the model's own tokenizer


def test_pickled_weights_and_single_files_are_hashed_by_size_and_edges(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text("{}")
    (a / "pytorch_model.bin").write_bytes(b"\x01" * 300_000)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert fp(a) == fp(b)
    (b / "pytorch_model.bin").write_bytes(b"\x01" * 299_999 + b"\x02")
    assert fp(a) != fp(b)
    # A model that is one file (GGUF): its name is not part of its identity, its bytes are.
    one, two = tmp_path / "m.gguf", tmp_path / "copy.gguf"
    one.write_bytes(b"GGUF" + b"\x00" * 1000)
    shutil.copy(one, two)
    assert fp(one) == fp(two) and fp(one).weight_files == 1


def test_garbage_that_looks_like_safetensors_is_hashed_opaquely(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text("{}")
    (a / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"junk")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text("{}")
    (tmp_path / "b" / "model.safetensors").write_bytes((5).to_bytes(8, "little") + b"[1,2]" + b"x" * 10)
    assert fp(a).source == "files" and fp(tmp_path / "b").source == "files"


def test_reads_are_bounded_whatever_the_weights_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text("{}")
    n_tensors, tensor_bytes = 10_000, 1 << 20
    header = {f"t{i}": {"dtype": "BF16", "shape": [tensor_bytes // 2],
                        "data_offsets": [i * tensor_bytes, (i + 1) * tensor_bytes]} for i in range(n_tensors)}
    raw = json.dumps(header).encode()
    with (a / "model.safetensors").open("wb") as f:  # a sparse 10 GB file
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + n_tensors * tensor_bytes)
    read: list[int] = []
    real = fpmod._pread

    def counting(f, offset, length):
        data = real(f, offset, length)
        read.append(len(data))
        return data

    monkeypatch.setattr(fpmod, "_pread", counting)
    assert fp(a).source == "files"
    limit = 8 + len(raw) + 2 * fpmod.EDGE_BYTES + fpmod.TENSOR_SAMPLES * fpmod.TENSOR_BYTES
    assert sum(read) <= limit and sum(read) < 10 << 20
    assert len(read) <= 4 + fpmod.TENSOR_SAMPLES


def test_unknown_models_fall_back_to_their_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    named = fp("Org/Some-Model")
    assert named.source == "name" and not named.weights_known and named.weight_files == 0
    assert named == fp("Org/Some-Model") != fp("Org/Other-Model")
    assert fp("Org/Some-Model", settings={"revision": "v2"}) != named
    for odd in ["s3://bucket/model", "a/b/c", "", None, "../x"]:
        assert fp(odd).source == "name"


def test_fingerprint_once_warns_once_per_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    fingerprint_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="sgl_kvtier.fingerprint"):
        first = fingerprint_once("Org/Uncached", None, (("revision", "main"),))
        again = fingerprint_once("Org/Uncached", None, (("revision", "main"),))
    assert first is again and first.source == "name"
    warned = [r for r in caplog.records if "the model name only" in r.getMessage()]
    assert len(warned) == 1 and "model_fingerprint" in warned[0].getMessage()
    caplog.clear()
    local = write_model(tmp_path / "local")
    with caplog.at_level(logging.WARNING, logger="sgl_kvtier.fingerprint"):
        assert fingerprint_once(str(local)).source == "files"
    assert caplog.records == []


def test_a_cached_hub_snapshot_is_read_with_its_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    repo = cache / "models--Org--Tiny"
    commit, other = "a" * 40, "b" * 40
    write_model(repo / "snapshots" / commit)
    shutil.copytree(repo / "snapshots" / commit, repo / "snapshots" / other)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit + "\n")
    assert resolve_local("Org/Tiny", None) == (repo / "snapshots" / commit, commit)
    assert resolve_local("Org/Tiny", other) == (repo / "snapshots" / other, other)
    assert resolve_local("Org/Tiny", "v9") == (None, None)
    hub = fp("Org/Tiny")
    assert hub.source == "hub-cache" and hub.weight_files == 2
    assert fp("Org/Tiny", settings={"revision": commit}) != hub  # the revision asked for is a setting too
    assert fp("Org/Tiny", settings={"revision": other}) != fp("Org/Tiny", settings={"revision": commit})
