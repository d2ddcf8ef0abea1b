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
    """In the streamed-tail test modules (``stream`` in their name), backends carry the stream plugin's side
    and prefill samples pass its batch observer, as in a process with ``KVTIER_STREAM=1``; in every other
    module neither, as by default."""
    if "stream" not in request.module.__name__:
        yield
        return
    from sgl_kvtier.experiments.streaming.backend_side import StreamingSide, install
    from sgl_kvtier.experiments.streaming.hooks import sample as stream_sample
    from sgl_kvtier.sglang import prefill_samples, storage

    install()
    stream_sample.install()
    try:
        yield
    finally:
        storage.EXTENSIONS.remove(StreamingSide)
        prefill_samples.OBSERVERS.remove(stream_sample.observe_batch)


@pytest.fixture(autouse=True)
def extensions_restored(monkeypatch):
    """A test that loads plugins (which add their side to ``storage.EXTENSIONS``, their batch observer and
    sampling claim to ``prefill_samples``, their status to ``plugins``) leaves all of it as it found it for the
    tests after it in this process."""
    from sgl_kvtier.sglang import plugins, prefill_samples, storage

    before = list(storage.EXTENSIONS), list(prefill_samples.OBSERVERS)
    monkeypatch.setattr(prefill_samples, "_every_batch", prefill_samples.every_batch_sampled())
    monkeypatch.setattr(plugins, "_status", dict(plugins._status))
    yield
    storage.EXTENSIONS[:], prefill_samples.OBSERVERS[:] = before
