"""StoreConfig: every bad value fails with an error naming its field; good input round-trips."""

from __future__ import annotations

import pytest

from sgl_kvtier.config import Durability, EvictionPolicyName, StoreConfig
from sgl_kvtier.errors import ConfigError


def test_defaults_and_round_trip():
    cfg = StoreConfig.from_mapping({"devices": ["/a", "/b"], "capacity_bytes": 1 << 30, "durability": "always"})
    assert cfg.devices == ("/a", "/b") and cfg.durability is Durability.ALWAYS
    assert cfg.eviction is EvictionPolicyName.CHAIN
    assert StoreConfig.from_mapping(cfg.to_mapping()) == cfg


def test_a_single_device_string_is_accepted():
    assert StoreConfig.from_mapping({"devices": "/a"}).devices == ("/a",)


@pytest.mark.parametrize("values, field", [
    ({}, "devices"),
    ({"devices": []}, "devices"),
    ({"devices": [1]}, "devices"),
    ({"devices": ["/a", "/a"]}, "devices"),
    ({"devices": ["/a"], "capacity_bytes": "10G"}, "capacity_bytes"),
    ({"devices": ["/a"], "capacity_bytes": -1}, "capacity_bytes"),
    ({"devices": ["/a"], "capacity_bytes": True}, "capacity_bytes"),
    ({"devices": ["/a"], "durability": "sometimes"}, "durability"),
    ({"devices": ["/a"], "eviction": "fifo"}, "eviction"),
    ({"devices": ["/a"], "io_engine": "spdk"}, "io_engine"),
    ({"devices": ["/a"], "io_depth": 0}, "io_depth"),
    ({"devices": ["/a"], "io_depth": 10 ** 6}, "io_depth"),
    ({"devices": ["/a"], "admission_threshold": 0}, "admission_threshold"),
    ({"devices": ["/a"], "segment_bytes": 1000}, "segment_bytes"),
    ({"devices": ["/a"], "checkpoint_interval": 0}, "checkpoint_interval"),
    ({"devices": ["/a"], "meta_dir": ""}, "meta_dir"),
    ({"devices": ["/a"], "direct_io": True}, "direct_io"),
    ({"devices": ["/a"], "capacity": 5}, "capacity"),
])
def test_bad_values_name_their_field(values, field):
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_mapping(values)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")


def test_ignored_keys_belong_to_someone_else():
    cfg = StoreConfig.from_mapping({"devices": ["/a"], "backend_name": "kvtier"}, ignore=frozenset({"backend_name"}))
    assert cfg.devices == ("/a",)


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        StoreConfig.from_mapping(["/a"])
