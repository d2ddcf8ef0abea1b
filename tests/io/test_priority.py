"""``io.priority``: ``KVTIER_IO_NICE`` adds to the niceness of our IO threads, one thread at a time, never the
process's; unset leaves them alone; a bad value, or a raise the process may not make, is logged once and
ignored. (A real engine's workers niced
while the caller is not: ``test_threads``.)"""

from __future__ import annotations

import logging
import os
import sys
import threading

import pytest

from sgl_kvtier.io import priority

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no setpriority on this platform")


def nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_setting_is_read_and_checked(monkeypatch, caplog) -> None:
    monkeypatch.setattr(priority, "_warned", set())
    assert priority.io_nice({}) == 0 and priority.io_nice({priority.ENV: " "}) == 0
    assert priority.io_nice({priority.ENV: "7"}) == 7 and priority.io_nice({priority.ENV: "19"}) == 19
    assert priority.io_nice({priority.ENV: "-20"}) == -20 and priority.io_nice({priority.ENV: " -5 "}) == -5
    with caplog.at_level(logging.WARNING, logger=priority.__name__):
        assert [priority.io_nice({priority.ENV: bad}) for bad in ("high", "-21", "20", "1.5")] == [0, 0, 0, 0]
    warned = [r for r in caplog.records if priority.ENV in r.getMessage()]
    assert len(warned) == 1 and "'high'" in warned[0].getMessage()  # once, naming the value


def test_unset_leaves_a_thread_as_it_was(monkeypatch) -> None:
    monkeypatch.delenv(priority.ENV, raising=False)
    got: list[int] = []

    def run() -> None:
        before = nice_of_this_thread()
        priority.renice_this_thread()
        got.extend([before, nice_of_this_thread()])

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got[0] == got[1]


def in_a_thread(fn) -> list:
    got: list = []
    t = threading.Thread(target=lambda: got.append(fn()))
    t.start()
    t.join()
    return got


def test_a_negative_step_raises_priority_where_allowed_and_is_logged_once_where_refused(monkeypatch, caplog) -> None:
    monkeypatch.setattr(priority, "_warned", set())
    monkeypatch.setenv(priority.ENV, "-3")
    base = nice_of_this_thread()

    def reniced() -> tuple[int, int]:
        before = nice_of_this_thread()
        priority.renice_this_thread()
        return before, nice_of_this_thread()

    before, after = in_a_thread(reniced)[0]
    assert before == base and nice_of_this_thread() == base  # the caller's thread keeps its priority
    if after == max(priority.MIN_NICE, before - 3):  # allowed here (root, CAP_SYS_NICE or RLIMIT_NICE)
        return

    assert after == before  # refused: left as it was
    assert any(priority.ENV in r.getMessage() for r in caplog.records)


def test_a_refused_raise_leaves_the_thread_and_warns_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(priority, "_warned", set())
    monkeypatch.setenv(priority.ENV, "-5")

    def refuse(*_args) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(priority.os, "setpriority", refuse)
    with caplog.at_level(logging.WARNING, logger=priority.__name__):
        got = in_a_thread(lambda: [priority.renice_this_thread() for _ in range(3)])
    assert got == [[None, None, None]]
    warned = [r.getMessage() for r in caplog.records if priority.ENV in r.getMessage()]
    assert len(warned) == 1 and "-5" in warned[0] and "not permitted" in warned[0]


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
