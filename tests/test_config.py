"""StoreConfig: every bad value fails with an error naming its field; good input round-trips."""

from __future__ import annotations

import pytest

from sgl_kvtier.config import Durability, EvictionPolicyName, FaultSpec, StoreConfig, ThrottleSpec
from sgl_kvtier.errors import ConfigError


def test_defaults_and_round_trip():
    cfg = StoreConfig.from_mapping({"devices": ["/a", "/b"], "capacity_bytes": 1 << 30, "durability": "always"})
    assert cfg.devices == ("/a", "/b") and cfg.durability is Durability.ALWAYS
    assert cfg.eviction is EvictionPolicyName.CHAIN
    assert StoreConfig.from_mapping(cfg.to_mapping()) == cfg


def test_a_device_string_is_refused_naming_the_field():
    """A string where the list belongs (one path or several) is refused before any path is looked at."""
    for raw in ("not-a-list", "/a,/b"):
        with pytest.raises(ConfigError, match=r"^devices: expected a list of paths, got the string") as info:
            StoreConfig.from_mapping({"devices": raw})
        assert info.value.field == "devices"


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


@pytest.mark.parametrize("table, field", [
    ("loud", "fault_injection"),
    ({"read_eror_rate": 0.1}, "fault_injection.read_eror_rate"),
    ({"read_error_rate": 1.5}, "fault_injection.read_error_rate"),
    ({"torn_write_rate": -0.1}, "fault_injection.torn_write_rate"),
    ({"stall_rate": "often"}, "fault_injection.stall_rate"),
    ({"stall_s": 1e9}, "fault_injection.stall_s"),
    ({"seed": 1.5}, "fault_injection.seed"),
    ({"seed": True}, "fault_injection.seed"),
    ({"control_file": ""}, "fault_injection.control_file"),
    ({"down": 0}, "fault_injection.down"),
    ({"down": [-1]}, "fault_injection.down"),
    ({"from_group": -1}, "fault_injection.from_group"),
    ({"from_group": 1.5}, "fault_injection.from_group"),
    ({"from_group": True}, "fault_injection.from_group"),
])  # fmt: skip
def test_fault_injection_errors_name_the_key(table, field):
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_mapping({"devices": ["/a"], "fault_injection": table})
    assert info.value.field == field and str(info.value).startswith(field + ":")


def test_fault_injection_table_round_trips_and_parses():
    table = {"seed": 7, "control_file": "/tmp/f.json", "read_error_rate": 0.25, "down": [1, 2], "stall_s": 2}
    cfg = StoreConfig.from_mapping({"devices": ["/a"], "fault_injection": table})
    assert cfg.fault_injection == table and StoreConfig.from_mapping(cfg.to_mapping()) == cfg
    assert cfg.fault_spec() == FaultSpec(seed=7, control_file="/tmp/f.json", read_error_rate=0.25, down=(1, 2),
                                         stall_s=2.0)
    assert StoreConfig.from_mapping({"devices": ["/a"]}).fault_spec() is None


def test_control_file_knobs_replace_only_what_they_name():
    base = FaultSpec(seed=3, control_file="/c", read_error_rate=0.5, stall_s=1.0)
    live = base.with_knobs({"read_error_rate": 0.0, "down": [0], "from_group": 1})
    assert live == FaultSpec(seed=3, control_file="/c", read_error_rate=0.0, stall_s=1.0, down=(0,), from_group=1)
    with pytest.raises(ConfigError) as info:  # the seed is the config's, not a live knob
        base.with_knobs({"seed": 9})
    assert info.value.field == "fault_injection.control_file.seed"


def test_throttle_errors_name_the_key():
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_mapping({"devices": ["/a"], "throttle": {"latency_s": 120}})
    assert info.value.field == "throttle.latency_s"
    cfg = StoreConfig.from_mapping({"devices": ["/a"], "throttle": {"read_bytes_per_s": 1e9}})
    assert cfg.throttle_spec() == ThrottleSpec(read_bytes_per_s=1e9)
