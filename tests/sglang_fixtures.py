"""Fixtures for the tests that run SGLang's classes in this process (tests/sglang, tests/experiments); a
pytest plugin of the suite (``tests/conftest.py``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cpu_shims():
    """Install the CPU shims the way SGLang's plugin loader does, once per test process."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sgl_kvtier.sglang.plugins import cpu as cpu_plugin

    mp = pytest.MonkeyPatch()
    mp.setenv(cpu_plugin.ENV_FLAG, "1")
    try:
        cpu_plugin.load()
        HookRegistry.apply_hooks()
    finally:
        mp.undo()
    import sglang.srt.mem_cache.pool_host.mha as mha

    assert hasattr(mha, "transfer_kv_direct"), "transfer_kv_direct stand-in missing"


@pytest.fixture
def single_rank(cpu_shims):
    """One rank (TP = PP = 1), forced the way SGLang's own kits do, with the CPU shims installed."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        yield


@pytest.fixture
def kit_on_cpu(single_rank, monkeypatch):
    """SGLang's unified-radix-cache unit kit with its device pointed at the CPU (skips before 0.5.23)."""
    fixtures = pytest.importorskip("sglang.test.kits.unified_radix_cache.fixtures",
                                   reason="SGLang's unified-radix-cache test kits are new in SGLang 0.5.23")

    monkeypatch.setattr(fixtures, "get_device", lambda *a, **k: "cpu")
    return fixtures


@pytest.fixture(scope="module", autouse=True)
def streaming_side(request):
    """In the streamed-tail test modules (``stream`` in their name), backends carry the stream plugin's side,
    as in a process with ``KVTIER_STREAM=1``; in every other module none does, as by default."""
    if "stream" not in request.module.__name__:
        yield
        return
    from sgl_kvtier.experiments.streaming.backend_side import StreamingSide, install
    from sgl_kvtier.sglang import storage

    install()
    try:
        yield
    finally:
        storage.EXTENSIONS.remove(StreamingSide)


@pytest.fixture(autouse=True)
def extensions_restored():
    """A test that loads the stream plugin (which adds its side to ``storage.EXTENSIONS``) leaves the list as
    it found it for the tests after it in this process."""
    from sgl_kvtier.sglang import storage

    before = list(storage.EXTENSIONS)
    yield
    storage.EXTENSIONS[:] = before
