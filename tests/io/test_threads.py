"""``io.threads``: our threads carry their names into the OS (what ``top -H`` and ``/proc/<pid>/task/*/comm``
show), the kernel's 15 bytes of them; a real engine's workers are named by one initializer, which also sets
the GIL switch interval where asked; a libc that refuses never stops a thread."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from sgl_kvtier.io import priority, threads
from sgl_kvtier.io.buffers import AlignedBuffer
from sgl_kvtier.io.engine import ThreadPoolEngine
from sgl_kvtier.io.ops import IOOp, OpKind

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are Linux's here")


def os_name_of_this_thread() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().rstrip("\n")


def in_thread(name: str, fn) -> list:
    got: list = []
    t = threading.Thread(target=lambda: got.append(fn()), name=name)
    t.start()
    t.join()
    return got


def test_a_thread_takes_its_python_name_or_the_one_given() -> None:
    assert in_thread("kvtier-lease", lambda: (threads.name_this_thread(), os_name_of_this_thread())) == [
        (True, "kvtier-lease")]
    assert in_thread("t", lambda: (threads.name_this_thread("kvtier-x"), os_name_of_this_thread())) == [
        (True, "kvtier-x")]
    # The kernel keeps 15 bytes: a longer name keeps its first 15.
    assert threads.os_name("kvtier-layer-loader") == b"kvtier-layer-lo"
    assert in_thread("kvtier-layer-loader", lambda: (threads.name_this_thread(), os_name_of_this_thread())) == [
        (True, "kvtier-layer-lo")]


def test_an_engines_workers_are_named_and_set_the_gil_switch(monkeypatch, tmp_path) -> None:
    """Two writes through the real thread-pool engine: each write's ``before_write`` runs on the worker that
    moves it, which carries the pool's name; the first worker set the switch interval
    ``KVTIER_GIL_SWITCH_US`` asks for."""
    monkeypatch.setattr(priority, "_switch_applied", False)
    monkeypatch.setenv(priority.SWITCH_ENV, "700")
    switch = sys.getswitchinterval()
    caller = os_name_of_this_thread()
    seen: list[str] = []
    engine = ThreadPoolEngine(2)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    bufs = [AlignedBuffer(4096) for _ in range(2)]
    try:
        def note(_parts: list[int]) -> None:
            seen.append(os_name_of_this_thread())

        ops = [IOOp(OpKind.WRITE, fd, i * 4096, [b.view], before_write=note) for i, b in enumerate(bufs)]
        assert all(r.ok for r in engine.run(ops))
        assert sys.getswitchinterval() == pytest.approx(0.0007)
    finally:
        engine.close()
        os.close(fd)
        for b in bufs:
            b.close()
        sys.setswitchinterval(switch)
    assert len(seen) == 2 and all(name.startswith("kvtier-io_") for name in seen)
    assert os_name_of_this_thread() == caller  # the caller's thread keeps its name


def test_a_refusing_libc_leaves_the_name_and_never_raises(monkeypatch) -> None:
    class Refusing:
        def prctl(self, *args):
            raise OSError("no prctl here")

    monkeypatch.setattr(threads, "_libc", lambda: Refusing())
    got = in_thread("kvtier-io_0", lambda: (os_name_of_this_thread(), threads.name_this_thread(),
                                            os_name_of_this_thread()))
    before, named, after = got[0]
    assert named is False and before == after
    monkeypatch.setattr(threads, "_libc", lambda: None)  # not Linux
    assert in_thread("kvtier-io_0", threads.name_this_thread) == [False]
