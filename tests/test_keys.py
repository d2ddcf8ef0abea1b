"""Keys and namespaces."""

from __future__ import annotations

import hashlib

import pytest

from sgl_kvtier.errors import ConfigError
from sgl_kvtier.keys import SCHEMA_VERSION, Namespace, parse_key, valid_runs


def ns(**kw):
    base = dict(model="m", dtype="bfloat16", layout="page_first", page_tokens=64, page_bytes=1 << 20)
    base.update(kw)
    return Namespace(**base)


def test_parse_key_accepts_sglang_hashes_only():
    h = hashlib.sha256(b"x").hexdigest()
    assert parse_key(h) == bytes.fromhex(h)
    for bad in [h.upper(), h[:-1], h + "0", "../" + h[3:], "g" * 64, 12, None, ""]:
        with pytest.raises(ValueError):
            parse_key(bad)


def test_every_field_changes_the_namespace():
    base = ns()
    variants = [ns(model="n"), ns(dtype="float16"), ns(layout="layer_first"), ns(page_tokens=32),
                ns(page_bytes=2 << 20), ns(tp_rank=1, tp_size=2), ns(tp_size=2), ns(pp_rank=1, pp_size=2),
                ns(cp_rank=1, cp_size=2), ns(schema_version=SCHEMA_VERSION + 1), ns(model_fingerprint="f00d"),
                ns(model_fingerprint="f00e"), ns(dcp_rank=1, dcp_size=2), ns(dcp_size=2)]
    digests = {v.digest() for v in variants} | {base.digest()}
    assert len(digests) == len(variants) + 1
    assert base.digest() == ns().digest()
    assert base.dirname() == "ns-" + base.digest().hex()


def test_namespace_validation():
    with pytest.raises(ConfigError, match="tp_rank"):
        ns(tp_rank=2, tp_size=2)
    with pytest.raises(ConfigError, match="page_bytes"):
        ns(page_bytes=0)
    with pytest.raises(ConfigError, match="model"):
        ns(model="")
    with pytest.raises(ConfigError, match="dcp_rank"):
        ns(dcp_rank=1, dcp_size=1)
    with pytest.raises(ConfigError, match="dcp_rank"):
        ns(dcp_size=0)
    for bad in ["has space", "x" * 129, "tab\t", "caf\u00e9", 7]:
        with pytest.raises(ConfigError, match="model_fingerprint"):
            ns(model_fingerprint=bad)
    assert Namespace.from_mapping(ns(tp_rank=1, tp_size=4).to_mapping()) == ns(tp_rank=1, tp_size=4)
    assert ns(tp_size=8, pp_size=2).shard_count == 16
    assert ns(dcp_size=4).shard_count == 4


def test_schema_2_names_the_weights_and_the_dcp_shard():
    assert SCHEMA_VERSION == 2
    full = ns(model_fingerprint="0123abcd", dcp_rank=1, dcp_size=2)
    assert Namespace.from_mapping(full.to_mapping()) == full
    line = full.describe()
    assert "weights=0123abcd" in line and "dcp1/2" in line and line.startswith("m ")
    assert "weights=- " in ns().describe()
    # A format-1 header (no appended fields) still reads, as what it was: schema 1, so another shard.
    old = {k: v for k, v in ns().to_mapping().items() if k not in ("model_fingerprint", "dcp_rank", "dcp_size")}
    old["schema_version"] = 1
    read = Namespace.from_mapping(old)
    assert (read.schema_version, read.model_fingerprint, read.dcp_rank, read.dcp_size) == (1, "", 0, 1)
    assert read.digest() != ns().digest()


def test_valid_runs_split_a_batch_at_its_invalid_keys():
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    assert valid_runs([a, None, b, c, None, None, d]) == [(0, [a]), (2, [b, c]), (6, [d])]
    assert valid_runs([None, a, b]) == [(1, [a, b])]
    assert valid_runs([a, b]) == [(0, [a, b])]
    assert valid_runs([None, None]) == [] and valid_runs([]) == []


def test_parts_join_the_identity_only_when_there_are_several():
    # Pinned: the digests of one-part namespaces are what they were before ``parts`` existed.
    assert ns().digest().hex() == "373c940bde41da6b5d5e3af6fbc1bc16"
    assert ns(layout="layer_first", page_tokens=16, page_bytes=1 << 16, tp_rank=1, tp_size=2, model_fingerprint="abc",
              dcp_size=2).digest().hex() == "60ecd4227d3cb18b30fa939ff8e4e98f"
    assert "parts" not in ns().to_mapping() and ns().part_sizes() == [1 << 20]
    assert ns(parts=(1 << 20,)) == ns() and ns(parts=[1 << 20]).parts == ()  # one part is the whole page
    split = ns(parts=[1 << 19, 1 << 18, 1 << 18])
    assert split.parts == (1 << 19, 1 << 18, 1 << 18) and split.part_sizes() == [1 << 19, 1 << 18, 1 << 18]
    assert split.digest() != ns().digest() != ns(parts=(1 << 18, 1 << 18, 1 << 19)).digest()
    assert split.to_mapping()["parts"] == [1 << 19, 1 << 18, 1 << 18]
    assert Namespace.from_mapping(split.to_mapping()) == split and "parts=3" in split.describe()
    assert hash(Namespace.from_mapping(split.to_mapping())) == hash(split)
    for bad in [(1 << 19,), (1 << 19, 0, 1 << 19), (-1, (1 << 20) + 1), ((1 << 20) - 64,) + (1,) * 64,
                (1 << 19, 1 << 19, 1), (True, (1 << 20) - 1), (1.0, (1 << 20) - 1.0)]:
        with pytest.raises(ConfigError, match="namespace.parts"):
            ns(parts=bad)
    assert len(ns(parts=(1 << 14,) * 64).parts) == 64
