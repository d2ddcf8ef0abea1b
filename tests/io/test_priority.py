"""``io.priority``: ``KVTIER_IO_NICE`` raises the niceness of our IO threads, one thread at a time, never the
process's; unset leaves them alone; a bad value is logged once and ignored. (A real engine's workers niced
while the caller is not: ``test_threads``.)"""

from __future__ import annotations

import logging
import os
import threading

import pytest

from sgl_kvtier.io import priority

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no setpriority on this platform")


def nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_setting_is_read_and_checked(monkeypatch, caplog) -> None:
    monkeypatch.setattr(priority, "_warned", False)
    assert priority.io_nice({}) == 0 and priority.io_nice({priority.ENV: " "}) == 0
    assert priority.io_nice({priority.ENV: "7"}) == 7 and priority.io_nice({priority.ENV: "19"}) == 19
    with caplog.at_level(logging.WARNING, logger=priority.__name__):
        assert [priority.io_nice({priority.ENV: bad}) for bad in ("high", "-1", "20")] == [0, 0, 0]
    warned = [r for r in caplog.records if priority.ENV in r.getMessage()]
    assert len(warned) == 1 and "'high'" in warned[0].getMessage()  # once, naming the value


def test_unset_leaves_a_thread_as_it_was(monkeypatch) -> None:
    monkeypatch.delenv(priority.ENV, raising=False)
    got: list[int] = []

    def run() -> None:
        before = nice_of_this_thread()
        priority.lower_this_thread()
        got.extend([before, nice_of_this_thread()])

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got[0] == got[1]
