"""The layer loader: a gated load through SGLang's own classes, and a real CPU server whose
load-backs run on the loader thread (the gate itself: ``tests/experiments/test_layer_gate.py``).

No test sleeps to synchronise: waiters are known to be parked through the gate's ``on_block`` hook, and a
copy is held in flight on a ``threading.Event``. Timeouts only bound a failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from hook_kit import keep_hooks  # noqa: E402
from thread_kit import BOUND_S, HeldCopy, Parked, finished, start  # noqa: E402

from sgl_kvtier.experiments.layer_loader import plugin as layer_loader  # noqa: E402

# The loader acts only where SGLang's device module is torch.cpu (on GPUs SGLang pipelines natively).
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU route: the loader is inert with a GPU")


LAYERS, PAGE, HEADS, DIM = 6, 16, 2, 8


@pytest.fixture
def raw_pools(single_rank, monkeypatch):
    """A real MHA device pool and layer_first host pool (random host KV), SGLang's layer counter (registered
    with the device pool, as ``HiCacheController`` does) and H2D engine; fresh loader counters."""
    from pools import host_pool_over
    from sglang.srt.managers.cache_controller import LayerDoneCounter
    from sglang.srt.mem_cache.l2_transfer import L2Transfer, L2TransferEngine
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    device = MHATokenToKVPool(512, PAGE, torch.float32, HEADS, DIM, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS - 1)
    host = host_pool_over(device, PAGE, "layer_first")
    g = torch.Generator().manual_seed(7)
    host.k_buffer.copy_(torch.randn(host.k_buffer.shape, generator=g))
    host.v_buffer.copy_(torch.randn(host.v_buffer.shape, generator=g))
    counter = LayerDoneCounter(LAYERS)
    device.register_layer_transfer_counter(counter)
    monkeypatch.setattr(layer_loader, "STATS", layer_loader.LoaderStats())
    host_idx, dev_idx = torch.arange(0, 4 * PAGE), torch.arange(2 * PAGE, 6 * PAGE)
    yield {"device": device, "host": host, "counter": counter, "engine": L2TransferEngine("direct"),
           "transfers": [L2Transfer(host, device, host_idx, dev_idx)], "host_idx": host_idx, "dev_idx": dev_idx}
    assert not layer_loader.IN_FLIGHT, "a load left in flight"


@pytest.fixture
def pools(raw_pools, monkeypatch):
    """``raw_pools`` with our wait hook on ``LayerDoneCounter.wait_until`` for this test only."""
    from sglang.srt.managers.cache_controller import LayerDoneCounter

    original_wait = LayerDoneCounter.wait_until
    monkeypatch.setattr(LayerDoneCounter, "wait_until",
                        lambda self, threshold: layer_loader.wait_until(original_wait, self, threshold))
    return raw_pools


def landed(p, layer: int) -> bool:
    dev, host = p["device"], p["host"]
    return bool(torch.equal(dev.k_buffer[layer][p["dev_idx"]], host.k_buffer[layer][p["host_idx"]])
                and torch.equal(dev.v_buffer[layer][p["dev_idx"]], host.v_buffer[layer][p["host_idx"]]))


def hold_layer(monkeypatch, host, held: int) -> HeldCopy:
    """Make the host pool's per-layer copy stop before layer ``held`` until released (then copy it)."""
    gate = HeldCopy(held)
    real = host.load_to_device_per_layer_physical

    def copy(device_pool, host_indices, device_indices, layer_id, io_backend, **kw):
        gate(layer_id)
        return real(device_pool, host_indices, device_indices, layer_id, io_backend, **kw)

    monkeypatch.setattr(host, "load_to_device_per_layer_physical", copy)
    return gate


def submit(p, on_block=None):
    """``start_loading``'s call, through our AROUND hook (or ``submit_async`` when ``on_block`` is given)."""
    from sglang.srt.mem_cache.l2_transfer import L2TransferEngine

    counter = p["counter"]
    event = counter.events[counter.update_producer()]
    kwargs = {"transfer_layer_id_max": LAYERS, "start_event": event.start_event, "on_layer_done": event.complete}
    if on_block is not None:
        assert layer_loader.eligible(p["engine"], p["transfers"], kwargs)
        return layer_loader.submit_async(p["engine"], p["transfers"], on_block=on_block, **kwargs)
    return layer_loader.submit_host_to_device(L2TransferEngine.submit_host_to_device, p["engine"], p["transfers"],
                                              **kwargs)


@cpu_only
def test_forward_reads_wait_for_exactly_the_layer_in_flight(pools, monkeypatch) -> None:
    p, held = pools, 3
    copy, parked = hold_layer(monkeypatch, p["host"], held), Parked()
    completion = submit(p, on_block=parked)
    assert copy.entered.wait(BOUND_S)
    assert completion.finish_event.query() is False  # honest: SGLang's ack is not ready
    p["counter"].set_consumer(p["counter"].producer_index)
    for layer in range(held):  # SGLang's attention read path: get_key_buffer -> wait_until(layer)
        p["device"].get_key_buffer(layer)
        assert landed(p, layer)
    t, out = start(p["device"].get_value_buffer, held)
    parked.wait_count(1)
    assert t.is_alive() and parked.layers == [held] and not landed(p, held)
    copy.release.set()
    assert finished(t) and isinstance(out[0], torch.Tensor) and landed(p, held)
    completion.finish_event.synchronize()  # SGLang's loading_check
    assert completion.finish_event.query() and all(landed(p, layer) for layer in range(LAYERS))
    assert layer_loader.stats()["loads"] == 1 and layer_loader.stats()["blocked_waits"] == 1


@cpu_only
def test_the_batch_end_joins_the_load(pools, monkeypatch) -> None:
    p = pools
    copy = hold_layer(monkeypatch, p["host"], 1)
    submit(p)
    assert copy.entered.wait(BOUND_S) and layer_loader.IN_FLIGHT
    t, out = start(layer_loader.join_after, None, object())  # AFTER Scheduler.run_batch
    copy.release.set()
    assert finished(t) and out == [None] and not layer_loader.IN_FLIGHT
    assert all(landed(p, layer) for layer in range(LAYERS))
    assert p["counter"].events[p["counter"].update_producer()].finish_event.query()


@cpu_only
def test_a_failed_loader_is_finished_by_the_forward_read(pools, monkeypatch, caplog) -> None:
    p = pools
    real = p["host"].load_to_device_per_layer_physical
    failures = iter([RuntimeError("injected")])

    def copy(device_pool, host_indices, device_indices, layer_id, io_backend, **kw):
        if layer_id == 2 and (err := next(failures, None)) is not None:
            raise err
        return real(device_pool, host_indices, device_indices, layer_id, io_backend, **kw)

    monkeypatch.setattr(p["host"], "load_to_device_per_layer_physical", copy)
    submit(p)
    p["device"].get_key_buffer(LAYERS - 1)
    assert all(landed(p, layer) for layer in range(LAYERS))
    layer_loader.join_all()
    s = layer_loader.stats()
    assert s["loader_failures"] == 1 and s["sync_layers"] == LAYERS - 2 and s["loads"] == 1
    assert "failed at layer 2 of 6" in caplog.text


@cpu_only
def test_other_calls_run_sglang_synchronously(pools) -> None:
    from sglang.srt.mem_cache.l2_transfer import L2TransferEngine

    p = pools  # the retraction-restore call: no per-layer events to gate on
    layer_loader.submit_host_to_device(L2TransferEngine.submit_host_to_device, p["engine"], p["transfers"],
                                       transfer_layer_id_max=LAYERS)
    assert not layer_loader.IN_FLIGHT and all(landed(p, layer) for layer in range(LAYERS))
    assert layer_loader.stats()["loads"] == 0


# ------------------------------------------------------------------------------------------ registration
def hook_targets():
    from sglang.srt.managers.cache_controller import LayerDoneCounter
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.l2_transfer import L2TransferEngine
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return ((L2TransferEngine, "submit_host_to_device"), (LayerDoneCounter, "wait_until"),
            (LayerDoneCounter, "update_producer"), (Scheduler, "run_batch"),
            (UnifiedRadixCache, "is_load_back_event_done"))


@pytest.fixture
def pristine(monkeypatch, cpu_shims):
    """The hook registry, the hooked SGLang methods and the plugin's load flag come back after the test."""
    originals = keep_hooks(monkeypatch, hook_targets())
    monkeypatch.setattr(layer_loader, "_loaded", False)
    return originals



@pytest.mark.parametrize("value", [None, "", "0"])
def test_off_touches_nothing(pristine, monkeypatch, value) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    if value is None:
        monkeypatch.delenv(layer_loader.ENV_FLAG, raising=False)
    else:
        monkeypatch.setenv(layer_loader.ENV_FLAG, value)
    hooks_before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    layer_loader.load()
    HookRegistry.apply_hooks()
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == hooks_before
    assert all(cls.__dict__[name] is pristine[name] for cls, name in hook_targets())
    assert not layer_loader._loaded


def test_inert_with_a_gpu(monkeypatch) -> None:
    monkeypatch.setenv(layer_loader.ENV_FLAG, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not layer_loader.loader_wanted()


@cpu_only
def test_registered_hooks_gate_sglangs_own_calls(pristine, raw_pools, monkeypatch) -> None:
    """``load()`` + ``apply_hooks()`` (SGLang's ``load_plugins``): SGLang's own method calls now load on
    the loader thread, its attention read path waits per layer, and ``update_producer`` joins."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setenv(layer_loader.ENV_FLAG, "1")
    layer_loader.load()
    HookRegistry.apply_hooks()
    for cls, name in hook_targets():
        assert cls.__dict__[name].__wrapped__ is pristine[name]
    layer_loader.load()  # idempotent: no second registration
    assert len(HookRegistry._hooks[layer_loader.SUBMIT_TARGET]) == 1

    p, held = raw_pools, 2
    copy, counter = hold_layer(monkeypatch, p["host"], held), p["counter"]
    event = counter.events[counter.update_producer()]
    counter.set_consumer(counter.producer_index)
    completion = p["engine"].submit_host_to_device(p["transfers"], transfer_layer_id_max=LAYERS,
                                                   start_event=event.start_event, on_layer_done=event.complete)
    assert copy.entered.wait(BOUND_S) and not completion.finish_event.query()
    p["device"].get_key_buffer(held - 1)
    assert landed(p, held - 1)
    t, out = start(p["device"].get_key_buffer, held)
    copy.release.set()
    assert finished(t) and landed(p, held)
    counter.update_producer()  # the next load's start joins this one
    assert not layer_loader.IN_FLIGHT and all(landed(p, layer) for layer in range(LAYERS))
    assert layer_loader.stats()["loads"] == 1


# ------------------------------------------------------------------------------------------ (c) real server
@pytest.mark.server
@cpu_only
def test_l2_hits_load_on_the_loader_thread_with_identical_output(tmp_path: Path) -> None:
    """Prompt A, then B and C push A out of the 2,048-token device pool into host memory only; A again is
    an L2 hit whose load-back runs on the loader thread: the greedy output is the cold (computed) one."""
    from sgl_kvtier.serving.model_factory import make_model, make_prompt
    from sgl_kvtier.serving.server import SGLangServer, tracebacks_through

    model = make_model(tmp_path / "model", "tiny")
    prompts = [make_prompt(900, seed=s, model_dir=model) for s in (11, 12, 13)]
    args = ["--max-total-tokens", "2048", "--hicache-ratio", "4", "--enable-hierarchical-cache",
            "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first", "--page-size", "16",
            "--enable-cache-report", "--skip-server-warmup"]
    log_path = tmp_path / "server.log"
    with SGLangServer(model, extra_args=args, env={layer_loader.ENV_FLAG: "1"}, log_path=log_path) as srv:
        cold = [srv.generate(p, max_new_tokens=8, temperature=0.0) for p in prompts]
        warm = srv.generate(prompts[0], max_new_tokens=8, temperature=0.0)
    log = log_path.read_text(errors="replace")
    details = warm["meta_info"]["cached_tokens_details"]
    assert details["host"] > 0, details
    assert warm["output_ids"] == cold[0]["output_ids"] and warm["text"] == cold[0]["text"]
    assert cold[0]["output_ids"] != cold[1]["output_ids"]  # the equality above is not vacuous
    assert "kvtier layer loader: first load-back on the loader thread: load-back of 896 tokens" in log
    assert "'loads': 1," in log and "'loader_failures': 0" in log
    assert tracebacks_through(log) == []
