"""``namespace_for``: the weights' identity, DP replicas under sharing, and DCP shards, from SGLang's config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from pools import needs, storage_config  # noqa: E402

from sgl_kvtier.fingerprint import fingerprint_model  # noqa: E402
from sgl_kvtier.serving.model_factory import _hf_config, spec_for  # noqa: E402
from sgl_kvtier.sglang.settings import namespace_for, served_model, store_config  # noqa: E402

PAGES = SimpleNamespace(layout="page_first", dtype="bfloat16", page_tokens=16, page_bytes=16 * 2048)


def extra(tmp_path: Path, **keys) -> dict:
    return {"devices": [str(tmp_path)], **keys}


def test_dp_replicas_share_one_namespace_unless_sharing_is_off(tmp_path: Path) -> None:
    pinned = extra(tmp_path, model_fingerprint="w1")
    ns = {r: namespace_for(storage_config(pinned, dp_rank=r), PAGES) for r in (0, 1, 3)}
    assert ns[0] == ns[1] == ns[3] and ns[1].model == "tiny-model"
    off = {**pinned, "sharing": "off"}
    ns_off = {r: namespace_for(storage_config(off, dp_rank=r), PAGES) for r in (0, 1, 3)}
    assert [n.model for n in ns_off.values()] == ["tiny-model", "tiny-model@dp1", "tiny-model@dp3"]
    assert len({n.digest() for n in ns_off.values()}) == 3
    assert ns_off[0] == ns[0]  # DP rank 0 (and a server without DP) is the same shard either way
    # The config the backend parsed gives the same answer as the one parsed again from the dict.
    assert namespace_for(storage_config(off, dp_rank=1), PAGES, config=store_config(off)) == ns_off[1]


def test_the_operator_fingerprint_is_used_as_is(tmp_path: Path) -> None:
    a = namespace_for(storage_config(extra(tmp_path, model_fingerprint="release-2024-06")), PAGES)
    b = namespace_for(storage_config(extra(tmp_path, model_fingerprint="release-2024-07")), PAGES)
    assert a.model_fingerprint == "release-2024-06" and a.model == b.model and a.digest() != b.digest()
    assert "weights=release-2024-06" in a.describe()


@needs("HiCacheStorageConfig.dcp_size", "0.5.23")
def test_dcp_shards_are_namespaced(tmp_path: Path) -> None:
    pinned = extra(tmp_path, model_fingerprint="w")
    ns = {r: namespace_for(storage_config(pinned, mla=True, tp_rank=r, tp_size=2, dcp_size=2, dcp_rank=r,
                                          logical_page_size=16), PAGES) for r in (0, 1)}
    assert (ns[0].dcp_rank, ns[0].dcp_size, ns[1].dcp_rank) == (0, 2, 1)
    assert (ns[1].tp_rank, ns[1].tp_size) == (0, 1)  # replicated: one shard per DCP rank, not per TP rank
    assert ns[0].digest() != ns[1].digest()
    plain = namespace_for(storage_config(pinned), PAGES)
    assert (plain.dcp_rank, plain.dcp_size) == (0, 1)


def _model(root: Path, weights: bytes) -> Path:
    """A model directory SGLang can publish server args for (a factory config.json) with given weight bytes."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps(_hf_config(spec_for("tiny", "bfloat16"), "bfloat16", 2, 0)))
    (root / "model.safetensors").write_bytes(weights)
    return root


@pytest.fixture
def published(cpu_shims):
    """Publish server args as SGLang's scheduler does; publish the kits' ``dummy`` ones again afterwards."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    def publish(model: Path, **args) -> None:
        set_global_server_args_for_scheduler(ServerArgs(model_path=str(model), device="cpu", skip_tokenizer_init=True,
                                                        **args))

    yield publish
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu"))


def test_the_fingerprint_comes_from_the_published_model_path(tmp_path: Path, published) -> None:
    a = _model(tmp_path / "a", b"\x00" * 8 + b"A" * 5000)
    other = _model(tmp_path / "other", b"\x00" * 8 + b"B" * 5000)
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    cfg = storage_config(extra(tmp_path), model="served-name")  # the same --served-model-name for all

    published(a)
    path, tokenizer, settings = served_model("served-name")
    assert (path, tokenizer) == (str(a), str(a)) and dict(settings)["kv_cache_dtype"] == "auto"
    ns_a = namespace_for(cfg, PAGES)
    assert ns_a.model_fingerprint == fingerprint_model(a, a, dict(settings)).value
    published(copy)
    assert namespace_for(cfg, PAGES) == ns_a  # byte-identical weights elsewhere: the same shard
    published(other)
    ns_other = namespace_for(cfg, PAGES)
    assert ns_other.model == ns_a.model and ns_other.digest() != ns_a.digest()
    published(a, quantization="fp8")
    assert namespace_for(cfg, PAGES).digest() != ns_a.digest()
    published(a)
    pinned = namespace_for(storage_config(extra(tmp_path, model_fingerprint="mine"), model="served-name"), PAGES)
    assert pinned.model_fingerprint == "mine"


def test_a_model_path_that_cannot_be_read_never_fails(tmp_path: Path, published) -> None:
    gone = _model(tmp_path / "gone", b"\x00" * 8 + b"G" * 100)
    published(gone)
    shutil.rmtree(gone)  # e.g. removed after the weights were loaded: the name stands for them
    ns = namespace_for(storage_config(extra(tmp_path)), PAGES)
    assert len(ns.model_fingerprint) == 32
    assert ns.model_fingerprint == fingerprint_model(gone, gone, dict(served_model("x")[2])).value
