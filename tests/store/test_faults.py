"""Device faults: injected EIO, ENOSPC, stalls, torn writes and vanishing devices never surface as
exceptions or wrong bytes; a circuit breaker stops IO to a sick device and probes it back."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support import HostMemory, key, open_store

from sgl_kvtier.store.health import BreakerState, DeviceHealth


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_breaker_opens_probes_and_closes():
    clock = FakeClock()
    h = DeviceHealth(["d0", "d1"], failures=3, cooldown_s=5.0, slow_op_s=1.0, clock=clock)
    for _ in range(2):
        h.record(0, ok=False)
    assert h.state(0) is BreakerState.CLOSED
    h.record(0, ok=True, seconds=2.0)  # slow counts as a failure
    assert h.state(0) is BreakerState.OPEN and not h.usable(0) and h.usable(1)
    clock.now = 5.0
    assert h.state(0) is BreakerState.HALF_OPEN and h.usable(0)
    h.record(0, ok=False)  # the probe fails: open again, twice as long
    assert h.state(0) is BreakerState.OPEN
    clock.now = 14.9
    assert h.state(0) is BreakerState.OPEN
    clock.now = 15.0
    h.record(0, ok=True, seconds=0.1)
    assert h.state(0) is BreakerState.CLOSED
    assert h.summary()[0] == {"device": "d0", "state": "closed", "trips": 2}


def store_with_faults(tmp_path, control, devices=None, **config):
    """A store whose faults come from ``control`` (JSON, re-read when it changes)."""
    if devices:
        config["devices"] = [str(d) for d in devices]
    return open_store(tmp_path, capacity_pages=64, fault_injection={"seed": 7, "control_file": str(control)},
                      breaker_cooldown_s=5.0, **config)


def fill(store, mem, first, count):
    expected = {first + j: mem.fill(j, first + j) for j in range(count)}
    ok = store.put([key(first + j) for j in range(count)], [mem.runs(j) for j in range(count)])
    return ok, expected


def test_read_errors_are_misses_then_the_breaker_opens_and_recovers(tmp_path):
    control = tmp_path / "faults.json"
    mem = HostMemory(8)
    store = store_with_faults(tmp_path, control)
    clock = FakeClock()
    store.health.clock = clock
    _, expected = fill(store, mem, 0, 8)
    control.write_text(json.dumps({"read_error_rate": 1.0}))
    assert store.get([key(0), key(1), key(2)], [mem.runs(i) for i in range(3)]) == [False] * 3
    assert store.health.state(0) is BreakerState.OPEN
    assert store.longest_prefix([key(i) for i in range(8)]) == 0  # SGLang is told "miss": it recomputes
    injected = store._engine.injected["error"]
    assert store.get([key(3)], [mem.runs(3)]) == [False]
    assert store._engine.injected["error"] == injected  # no IO was sent to the sick device
    control.write_text(json.dumps({"read_error_rate": 0.0}))
    clock.now = 5.0  # the cool-down passes: a probe goes through, succeeds, and the circuit closes
    mem.clear()
    assert store.get([key(4)], [mem.runs(0)]) == [True] and mem.page(0).tobytes() == expected[4]
    assert store.health.state(0) is BreakerState.CLOSED
    assert store.longest_prefix([key(i) for i in range(8)]) == 8  # the pages were kept: hits resume
    store.close()


def test_a_vanished_device_only_costs_its_own_pages(tmp_path):
    devs = [tmp_path / "a", tmp_path / "b"]
    for d in devs:
        d.mkdir()
    control = tmp_path / "faults.json"
    mem = HostMemory(8)
    store = store_with_faults(tmp_path, control, devices=devs)
    _, expected = fill(store, mem, 0, 8)  # slots stripe: even pages on a, odd on b
    control.write_text(json.dumps({"down": [1]}))
    mem.clear()
    got = store.get([key(i) for i in range(8)], [mem.runs(i) for i in range(8)])
    assert got == [True, False] * 4
    assert all(mem.page(i).tobytes() == expected[i] for i in range(0, 8, 2))
    ok, _ = fill(store, mem, 100, 4)
    assert ok[0] is True and ok[1] is False  # writes to the gone device fail, the other device takes them
    store.close()


def test_enospc_and_torn_writes(tmp_path):
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"enospc_rate": 1.0}))
    mem = HostMemory(8)
    store = store_with_faults(tmp_path, control, breaker_failures=100)
    ok, _ = fill(store, mem, 0, 4)
    assert ok == [False] * 4 and len(store) == 0
    control.write_text(json.dumps({"torn_write_rate": 1.0}))
    ok, _ = fill(store, mem, 10, 4)
    assert ok == [True] * 4  # the device said "done"...
    got = store.get([key(10 + i) for i in range(4)], [mem.runs(i) for i in range(4)])
    assert got == [False] * 4  # ...but the bytes are not all there: checksums turn them into misses
    assert store.stats().counters["corrupt_pages"] == 4 and len(store) == 0
    store.close()


def test_stalls_count_as_sickness(tmp_path):
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"stall_rate": 1.0, "stall_s": 0.05}))
    mem = HostMemory(4)
    store = open_store(tmp_path, fault_injection={"seed": 1, "control_file": str(control)}, slow_io_s=0.01,
                       breaker_failures=2)
    ok, expected = fill(store, mem, 0, 2)
    assert ok == [True, True]  # slow but done
    assert store.health.state(0) is BreakerState.OPEN
    store.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_fault_soak_never_serves_wrong_bytes(tmp_path, seed):
    rng = np.random.default_rng(seed)
    faults = {"seed": seed, "read_error_rate": 0.1, "write_error_rate": 0.1, "torn_write_rate": 0.1,
              "enospc_rate": 0.05}
    mem = HostMemory(16)
    truth: dict[int, bytes] = {}
    store = open_store(tmp_path, capacity_pages=48, fault_injection=faults, breaker_failures=10_000)
    served = 0
    for step in range(60):
        first = int(rng.integers(0, 200))
        count = int(rng.integers(1, 8))
        data = {first + j: mem.fill(j, seed * 1000 + first + j) for j in range(count)}
        present = {n for n in data if store.contains(key(n))}
        store.put([key(n) for n in data], [mem.runs(j) for j in range(count)])
        truth.update({n: b for n, b in data.items() if n not in present})
        ask = [int(x) for x in rng.integers(0, 200, size=8)]
        mem.clear()
        got = store.get([key(n) for n in ask], [mem.runs(j) for j in range(8)])
        for j, (n, ok) in enumerate(zip(ask, got)):
            if ok:
                assert mem.page(j).tobytes() == truth[n], f"step {step}: wrong bytes for page {n}"
                served += 1
    assert served > 0 and store.stats().counters["io_errors"] > 0
    store.close()
