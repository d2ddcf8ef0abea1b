"""``io.priority``: ``KVTIER_GIL_SWITCH_US`` sets Python's switch interval once per process; unset leaves
Python's; a bad value is logged once and ignored."""

from __future__ import annotations

import logging
import sys

import pytest

from sgl_kvtier.io import priority


def test_the_gil_switch_interval_is_read_checked_and_set_once_per_process(monkeypatch, caplog) -> None:
    monkeypatch.setattr(priority, "_warned", set())
    assert priority.gil_switch_s({}) is None and priority.gil_switch_s({priority.SWITCH_ENV: "1000"}) == 0.001
    with caplog.at_level(logging.WARNING, logger=priority.__name__):
        assert [priority.gil_switch_s({priority.SWITCH_ENV: bad}) for bad in ("fast", "10", "200000")] == [None] * 3
    warned = [r.getMessage() for r in caplog.records if priority.SWITCH_ENV in r.getMessage()]
    assert len(warned) == 1 and "'fast'" in warned[0]

    before = sys.getswitchinterval()
    monkeypatch.setattr(priority, "_switch_applied", False)
    monkeypatch.setenv(priority.SWITCH_ENV, "700")
    try:
        priority.apply_gil_switch()
        assert sys.getswitchinterval() == pytest.approx(0.0007)
        monkeypatch.setenv(priority.SWITCH_ENV, "2000")
        priority.apply_gil_switch()  # once per process: a later call changes nothing
        assert sys.getswitchinterval() == pytest.approx(0.0007)
    finally:
        sys.setswitchinterval(before)
