"""The configuration reference: every key, table key and enum member documents itself where it is declared,
and the generated page shows each with its real type, default and values."""

from __future__ import annotations

import dataclasses
import enum
import typing

import pytest
from docs_support import hooks

from sgl_kvtier.config import (
    DOC,
    FAULT_KEYS,
    THROTTLE_KEYS,
    DocumentedEnum,
    FaultSpec,
    StoreConfig,
    ThrottleSpec,
)
from sgl_kvtier.serving.launch import BACKEND, SGLANG_EXTRA_KEYS
from sgl_kvtier.sglang.settings import SGLANG_KEYS

SPECS = (StoreConfig, ThrottleSpec, FaultSpec)


def enum_types(cls: type) -> dict[str, type[enum.Enum]]:
    """Field name -> its enum type, for the enum-typed fields of ``cls``."""
    out = {}
    for name, tp in typing.get_type_hints(cls).items():
        found = [a for a in (tp, *typing.get_args(tp)) if isinstance(a, type) and issubclass(a, enum.Enum)]
        if found:
            out[name] = found[0]
    return out


@pytest.mark.parametrize("cls", SPECS, ids=lambda c: c.__name__)
def test_every_key_has_documentation(cls):
    undocumented = [f.name for f in dataclasses.fields(cls) if not str(f.metadata.get(DOC, "")).strip()]
    assert not undocumented, f"{cls.__name__} keys without metadata['doc']: {undocumented}"


def test_every_enum_member_has_a_meaning():
    types = {tp for cls in SPECS for tp in enum_types(cls).values()}
    assert types, "the config has enum-typed keys"
    for tp in types:
        assert issubclass(tp, DocumentedEnum), f"{tp.__name__} is not a DocumentedEnum: its members carry no meaning"
        for member in tp:
            meaning = hooks().member_doc(member)
            assert meaning, f"{tp.__name__}.{member.name} has no meaning"
            assert meaning != tp.__doc__


def test_documented_enums_keep_their_values_and_behaviour():
    """``NAME = value, meaning`` leaves the value the config string: parsing, equality and round trips as before."""
    cfg = StoreConfig.from_mapping({"devices": ["/d"], "durability": "none", "sharing": "cluster", "streaming": "on"})
    assert cfg.to_mapping()["durability"] == "none" and cfg.durability == "none"
    assert StoreConfig.from_mapping(cfg.to_mapping()) == cfg
    for tp in enum_types(StoreConfig).values():
        assert [tp(m.value) for m in tp] == list(tp)
        assert all(isinstance(m.value, str) and m.value == str.__str__(m) for m in tp)


def test_documentation_does_not_change_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(StoreConfig)}
    assert defaults["devices"] is dataclasses.MISSING
    assert StoreConfig(devices=("/d",)) == StoreConfig.from_mapping({"devices": ["/d"]})
    assert StoreConfig(devices=("/d",)).segment_bytes == 1 << 30
    assert ThrottleSpec() == ThrottleSpec.from_mapping({}) and FaultSpec() == FaultSpec.from_mapping({})


def test_the_tables_are_their_specs():
    """Every table key of StoreConfig is documented by its spec, whose fields are exactly the accepted keys."""
    h = hooks()
    hints = typing.get_type_hints(StoreConfig)
    tables = {name for name, tp in hints.items() if any(typing.get_origin(a) is dict for a in (tp, *typing.get_args(tp)))}
    assert tables == set(h.TABLES)
    assert tuple(f.name for f in dataclasses.fields(ThrottleSpec)) == THROTTLE_KEYS
    assert {f.name for f in dataclasses.fields(FaultSpec)} == set(FAULT_KEYS)
    assert h.TABLES == {"throttle": ThrottleSpec, "fault_injection": FaultSpec}


def test_sglang_keys_are_documented_exactly():
    h = hooks()
    assert set(h.SGLANG_KEY_DOCS) == SGLANG_KEYS
    assert all(text.strip() for text in h.SGLANG_KEY_DOCS.values())
    assert set(BACKEND) <= SGLANG_KEYS and set(SGLANG_EXTRA_KEYS) <= SGLANG_KEYS


def test_the_page_shows_every_key_with_its_type_default_and_values():
    page = hooks().configuration()
    for cls, prefix in ((StoreConfig, ""), (ThrottleSpec, "throttle."), (FaultSpec, "fault_injection.")):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            heading = f"### `{prefix}{f.name}`"
            assert heading in page, heading
            section = page.split(heading, 1)[1].split("\n### ", 1)[0]
            assert " ".join(f.metadata[DOC].split()[:4]) in section
            assert f"- Type: {hooks()._kind(hints[f.name])}" in section
            assert "- Default: " in section
    durability = page.split("### `durability`", 1)[1].split("\n### ", 1)[0]
    assert '- Default: `"batch"`' in durability
    assert '`"none"`: Never forced' in durability
    assert "- Default: required" in page.split("### `devices`", 1)[1]
    assert "| `hicache_storage_pass_prefix_keys` | `true` |" in page
    assert "| `prefetch_threshold` | from `[sglang]` |" in page


def test_an_undocumented_key_fails_the_page():
    """The generator refuses a field without documentation (a key added without it fails the build)."""
    from mkdocs.exceptions import PluginError

    @dataclasses.dataclass(frozen=True)
    class Spec:
        documented: int = dataclasses.field(default=1, metadata={DOC: "Has one."})
        bare: int = 2

    with pytest.raises(PluginError, match="bare has no documentation"):
        hooks()._keys(Spec)
