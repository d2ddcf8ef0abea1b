"""factory: the engine stack, and io_engine = "uring" where io_uring cannot run.

A store asked for an engine whose probe dies by SIGILL must fail to open with one ConfigError naming
``io_engine`` and the reason, never run the engine's native code in-process, and never probe for
``auto``.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
from support import open_store, store_config

from sgl_kvtier.config import IOEngineName
from sgl_kvtier.errors import ConfigError
from sgl_kvtier.io import probe as probes
from sgl_kvtier.io.engine import ThreadPoolEngine
from sgl_kvtier.io.factory import make_engine, open_engine
from sgl_kvtier.io.probe import Probe, ProbeStatus
from sgl_kvtier.io.uring import UringEngine

SIGILL_URING = Probe("uring", "probe_targets:die_sigill", packages=("liburing",))


def test_a_store_with_an_engine_whose_probe_dies_by_sigill_fails_naming_io_engine(probe_cache, monkeypatch,
                                                                                  tmp_path):
    monkeypatch.setitem(probes.PROBES, "uring", SIGILL_URING)
    with pytest.raises(ConfigError) as err:
        open_store(tmp_path, io_engine="uring")
    assert err.value.field == "io_engine" and str(err.value).startswith('io_engine: "uring" cannot run')
    assert "SIGILL: the liburing" in str(err.value) and "instructions this CPU lacks" in str(err.value)
    assert 'io_engine = "auto"' in str(err.value)  # what to do about it
    with pytest.raises(ConfigError, match="SIGILL"):  # memoised: the same answer again
        open_store(tmp_path, io_engine="uring")
    assert [e["status"] for e in json.loads(probe_cache.read_text())["entries"].values()] == ["crashed"]


def test_the_uring_engine_itself_refuses_to_start_without_the_probe(probe_cache, monkeypatch):
    monkeypatch.setitem(probes.PROBES, "uring", SIGILL_URING)
    with pytest.raises(probes.ProbeUnavailableError) as err:
        UringEngine(4)
    assert err.value.verdict.status is ProbeStatus.CRASHED
    assert UringEngine.probe() is False


def test_no_liburing_in_process_before_or_after_a_failed_probe(tmp_path):
    """In a fresh interpreter: importing the IO layer and failing to open uring never imports liburing."""
    script = textwrap.dedent("""
        import sys
        from sgl_kvtier.io import factory, probe, uring
        assert "liburing" not in sys.modules, "imported by the IO layer's modules"
        probe.PROBES["uring"] = probe.Probe("uring", "probe_targets:die_sigill", packages=("liburing",))
        try:
            factory.make_engine("uring", 4)
        except Exception as exc:
            print(type(exc).__name__, exc.field)
        assert "liburing" not in sys.modules, "imported in-process despite the probe"
    """)
    env_path = ":".join(p for p in sys.path if p)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                         env={"PYTHONPATH": env_path, probes.CACHE_ENV: str(tmp_path / "probe.json"),
                              "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ConfigError io_engine"


def test_auto_and_threads_are_the_thread_pool_and_never_probe(probe_cache, monkeypatch):
    monkeypatch.setitem(probes.PROBES, "uring", SIGILL_URING)  # a probe would fail loudly
    for name in ("auto", IOEngineName.AUTO, "threads", IOEngineName.THREADS):
        engine = make_engine(name, 2)
        try:
            assert isinstance(engine, ThreadPoolEngine) and engine.name == "threads"
        finally:
            engine.close()
    assert not probe_cache.exists()  # no probe ran, so nothing was written


def test_an_unknown_engine_name_names_io_engine():
    with pytest.raises(ConfigError) as err:
        make_engine("spdk", 2)
    assert err.value.field == "io_engine" and "spdk" in str(err.value)


def test_uring_where_the_probe_says_available(probe_cache):
    verdict = probes.check("uring")
    if not verdict.available:
        pytest.skip(verdict.reason)
    engine = make_engine("uring", 4)
    try:
        assert isinstance(engine, UringEngine) and engine.depth == 4
    finally:
        engine.close()


@pytest.mark.parametrize("tables, name", [
    ({}, "threads"),
    ({"fault_injection": {}, "throttle": {}}, "threads"),  # empty tables inject and throttle nothing
    ({"fault_injection": {"seed": 3}}, "faulty(threads)"),
    ({"throttle": {"latency_s": 0.0}}, "throttled(threads)"),
    ({"fault_injection": {"seed": 3}, "throttle": {"latency_s": 0.0}}, "throttled(faulty(threads))"),
])  # fmt: skip
def test_the_stack_order(tmp_path, tables, name):
    engine = open_engine(store_config(tmp_path, **tables))
    try:
        assert engine.name == name
    finally:
        engine.close()


def test_a_given_base_engine_is_wrapped_not_replaced(tmp_path):
    base = ThreadPoolEngine(2)
    engine = open_engine(store_config(tmp_path, throttle={"latency_s": 0.0}, io_engine="uring"), base)
    assert engine.name == "throttled(threads)" and engine.inner is base  # no uring probe, no uring
    engine.close()


def test_a_ring_that_cannot_be_set_up_names_io_engine(probe_cache, monkeypatch):
    monkeypatch.setitem(probes.PROBES, "uring", Probe("uring", "probe_targets:ok"))  # the probe passes

    def no_ring(self, depth):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(UringEngine, "_setup", no_ring)
    with pytest.raises(ConfigError) as err:
        make_engine("uring", 64)
    assert err.value.field == "io_engine" and "ring of depth 64" in str(err.value)
