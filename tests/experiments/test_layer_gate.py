"""The per-layer gate and the layer-by-layer load (the streaming machinery): pure threading, no SGLang.

No test sleeps to synchronise: waiters are known to be parked through the gate's ``on_block`` hook, and a
copy is held in flight on a ``threading.Event``. Timeouts only bound a failure.
"""

from __future__ import annotations

import threading

import pytest
from thread_kit import BOUND_S, HeldCopy, Parked, finished, start

from sgl_kvtier.experiments.layer_loader.layer_gate import LayerGate, LayerLoad


# ------------------------------------------------------------------------------------------ (a) the gate
def test_waiters_are_released_in_layer_order() -> None:
    parked = Parked()
    gate = LayerGate(5, on_block=parked)
    waiters = [start(gate.wait_until, layer) for layer in range(5)]
    parked.wait_count(5)
    for layer in range(5):
        assert all(t.is_alive() for t, _ in waiters[layer:]), f"a waiter of layer >= {layer} returned early"
        gate.advance(layer)
        t, out = waiters[layer]
        assert finished(t) and out == [True]
    assert gate.complete and gate.wait_until(4) and gate.error is None


def test_advance_releases_every_earlier_layer_and_never_goes_back() -> None:
    gate = LayerGate(4)
    gate.advance(2)
    assert gate.done == 3 and gate.is_done(2) and not gate.is_done(3)
    gate.advance(0)
    assert gate.done == 3
    assert gate.wait_until(3, timeout=0) is False  # not complete, not failed: the timeout answers
    with pytest.raises(ValueError):
        gate.advance(4)
    with pytest.raises(ValueError):
        LayerGate(-1)
    gate.finish()
    assert gate.complete and LayerGate(0).complete


def test_fail_releases_every_waiter_of_a_missing_layer() -> None:
    parked = Parked()
    gate = LayerGate(4, on_block=parked)
    gate.advance(1)
    waiters = [start(gate.wait_until, layer) for layer in (2, 3, 3)]
    parked.wait_count(3)
    err = RuntimeError("copy failed")
    gate.fail(err)
    for t, out in waiters:
        assert finished(t) and out == [False]
    assert gate.error is err and gate.wait_until(1) and not gate.wait_until(2)
    gate.advance(3)  # a thread that finished the load for the failed loader
    assert gate.wait_until(3) and gate.error is err


@pytest.mark.parametrize("round_", range(5))
def test_no_lost_wakeups(round_: int) -> None:
    layers, waiters_n = 48, 24
    gate = LayerGate(layers)
    barrier = threading.Barrier(waiters_n + 1)

    def waiter(i: int) -> bool:
        barrier.wait()
        return all(gate.wait_until(layer) for layer in range((i * 7 + round_) % layers, layers, 5))

    waiters = [start(waiter, i) for i in range(waiters_n)]
    barrier.wait()  # advancing races with waiters entering and leaving their waits
    for layer in range(layers):
        gate.advance(layer)
    for t, out in waiters:
        assert finished(t) and out == [True]


# ------------------------------------------------------------------------------------------ (b) LayerLoad
def test_a_held_layer_blocks_its_waiter_while_earlier_layers_pass() -> None:
    copy, parked, done = HeldCopy(held=3), Parked(), []
    job = LayerLoad(6, copy, done.append, on_block=parked)
    job.start()
    assert copy.entered.wait(BOUND_S)
    for layer in range(3):
        job.wait(layer)  # returns at once: already landed
    t, out = start(job.wait, 3)
    parked.wait_count(1)
    assert t.is_alive() and copy.copied == [0, 1, 2] and done == [0, 1, 2]
    copy.release.set()
    assert finished(t) and out == [None] and 3 in copy.copied
    job.join()
    assert job.complete and copy.copied == done == list(range(6)) and job.loader_error is None
    assert job.blocked_waits == 1 and job.sync_layers == 0


def test_a_loader_failure_is_finished_by_the_waiting_thread(caplog) -> None:
    copy = HeldCopy(held=-1, fail_at=2)
    job = LayerLoad(5, copy)
    job.start()
    job.wait(4)  # the loader fails at 2; this thread copies 2, 3, 4 itself
    assert job.complete and copy.copied == [0, 1, 2, 3, 4]
    assert isinstance(job.loader_error, RuntimeError) and job.sync_layers == 3
    job.join()
    assert "failed at layer 2 of 5" in caplog.text


def test_join_finishes_a_failed_load_nobody_waited_for() -> None:
    copy = HeldCopy(held=-1, fail_at=0)
    job = LayerLoad(3, copy)
    job.start()
    job.join()
    assert job.complete and copy.copied == [0, 1, 2] and job.sync_layers == 3
