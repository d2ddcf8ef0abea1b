"""``io.priority``: ``KVTIER_IO_NICE`` raises the niceness of our IO threads, one thread at a time, never the
process's; unset leaves them alone; a bad value is logged once and ignored."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from sgl_kvtier.io import priority
from sgl_kvtier.io.buffers import AlignedBuffer
from sgl_kvtier.io.engine import ThreadPoolEngine
from sgl_kvtier.io.ops import IOOp, OpKind

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


def test_an_engines_io_threads_run_niced_and_the_caller_does_not(monkeypatch, tmp_path) -> None:
    """Two writes through the real thread-pool engine (two ops: they run on its workers): each write's
    ``before_write``, called on the worker that moves it, sees the worker's niceness raised by 3."""
    monkeypatch.setenv(priority.ENV, "3")
    base = nice_of_this_thread()
    seen: list[int] = []
    engine = ThreadPoolEngine(2)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    bufs = [AlignedBuffer(4096) for _ in range(2)]
    try:
        def note(_parts: list[int]) -> None:
            seen.append(nice_of_this_thread())

        ops = [IOOp(OpKind.WRITE, fd, i * 4096, [b.view], before_write=note) for i, b in enumerate(bufs)]
        assert all(r.ok for r in engine.run(ops))
    finally:
        engine.close()
        os.close(fd)
        for b in bufs:
            b.close()
    assert seen == [min(priority.MAX_NICE, base + 3)] * 2
    assert nice_of_this_thread() == base  # the caller's thread (and the process) untouched


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
