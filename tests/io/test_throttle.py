"""ThrottledEngine: the emulated device's bandwidth, latency and queue, validation, and a throttled PageStore.

The device-model tests run on a fake clock whose ``sleep`` advances it, with an inner engine that does no
IO, so every figure is exact and nothing waits. One test checks the real clock with generous bounds.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
from support import HostMemory, key, open_store

from sgl_kvtier.config import StoreConfig, ThrottleSpec
from sgl_kvtier.errors import ConfigError
from sgl_kvtier.io.engine import ThreadPoolEngine
from sgl_kvtier.io.ops import IOOp, IOResult, OpKind, op_length
from sgl_kvtier.io.throttle import ThrottledEngine, transfer_s


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class NullEngine:
    """Moves no bytes; answers every op as done in 0 s. ``depth`` is the emulated queue depth."""

    name = "null"

    def __init__(self, depth: int = 32) -> None:
        self.depth = depth
        self.calls = 0

    def run(self, ops):
        self.calls += 1
        return [IOResult(op_length(op), None) for op in ops]

    def close(self) -> None:
        pass


def ops(n: int, nbytes: int, kind: OpKind = OpKind.READ) -> list[IOOp]:
    return [IOOp(kind, -1, 0, [memoryview(bytearray(nbytes))], checksum=False) for _ in range(n)]


def engine(depth: int = 32, **settings) -> tuple[ThrottledEngine, FakeClock]:
    clock = FakeClock()
    return ThrottledEngine(NullEngine(depth), ThrottleSpec.from_mapping(settings), clock=clock, sleep=clock.sleep), clock


def test_bytes_take_bytes_over_rate() -> None:
    eng, clock = engine(read_bytes_per_s=1e6, write_bytes_per_s=2e6)
    res = eng.run(ops(4, 250_000))  # 1 MB at 1 MB/s
    assert clock.now == pytest.approx(101.0)
    # The ops queue behind each other: the k-th finishes k/4 s after the batch was issued.
    assert [r.seconds for r in res] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(r.ok and r.nbytes == 250_000 for r in res)
    eng.run(ops(2, 500_000, OpKind.WRITE))  # 1 MB at 2 MB/s
    assert clock.now == pytest.approx(101.5)
    assert eng.waited_s == pytest.approx(1.5)


def test_uncapped_kind_and_idle_device_cost_nothing() -> None:
    eng, clock = engine(read_bytes_per_s=1e6)
    eng.run(ops(3, 1 << 20, OpKind.WRITE))
    assert clock.slept == [] and clock.now == 100.0
    clock.now += 10  # an idle device has no backlog: the next read costs its own bytes only
    eng.run(ops(1, 500_000))
    assert clock.now == pytest.approx(110.5)


def test_latency_overlaps_across_ops_in_flight_up_to_the_queue_depth() -> None:
    eng, clock = engine(depth=4, latency_s=0.01)
    res = eng.run(ops(4, 4096))
    assert clock.now == pytest.approx(100.01) and [r.seconds for r in res] == pytest.approx([0.01] * 4)
    eng, clock = engine(depth=2, latency_s=0.01)
    res = eng.run(ops(5, 4096))  # waves of 2: issued at 0, 0, 0.01, 0.01, 0.02
    assert clock.now == pytest.approx(100.03)
    assert [r.seconds for r in res] == pytest.approx([0.01] * 5)  # from each op's issue, not the batch's


def test_latency_adds_to_transfer() -> None:
    eng, clock = engine(read_bytes_per_s=1e6, latency_s=0.005)
    eng.run(ops(10, 100_000))
    assert clock.now == pytest.approx(101.005)  # k * n / rate + latency
    eng, clock = engine(depth=1, read_bytes_per_s=1e6, latency_s=0.005)
    eng.run(ops(10, 100_000))
    assert clock.now == pytest.approx(100 + 10 * 0.105)  # one op at a time: each pays its latency


def test_concurrent_callers_share_the_cap() -> None:
    """A second caller arriving while the device is busy queues behind the first caller's bytes."""
    eng, clock = engine(read_bytes_per_s=1e6, write_bytes_per_s=1e6)
    first = eng.schedule(ops(2, 500_000), clock())  # caller 1: 1 s of device time
    second = eng.schedule(ops(1, 250_000, OpKind.WRITE), clock() + 0.1)  # caller 2, reads and writes share
    assert [d for _, d in first] == pytest.approx([100.5, 101.0])
    assert second == [(pytest.approx(100.1), pytest.approx(101.25))]


def test_real_threads_share_the_cap_on_the_real_clock() -> None:
    """Behaviour of the emulator on the wall clock: 4 threads x 4 x 64 KiB at 4 MiB/s take >= 0.25 s."""
    eng = ThrottledEngine(NullEngine(), ThrottleSpec(read_bytes_per_s=4 << 20))
    t0 = time.monotonic()
    threads = [threading.Thread(target=eng.run, args=(ops(4, 64 << 10),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    assert 0.25 * 0.95 <= elapsed < 5.0
    assert eng.inner.calls == 4


@pytest.mark.parametrize("settings, field", [
    ({"read_bytes_per_second": 1}, "throttle.read_bytes_per_second"),
    ({"read_bytes_per_s": 0}, "throttle.read_bytes_per_s"),
    ({"write_bytes_per_s": -5}, "throttle.write_bytes_per_s"),
    ({"write_bytes_per_s": "50M"}, "throttle.write_bytes_per_s"),
    ({"read_bytes_per_s": True}, "throttle.read_bytes_per_s"),
    ({"latency_s": -0.001}, "throttle.latency_s"),
    ({"latency_s": math.nan}, "throttle.latency_s"),
    ("fast", "throttle"),
])  # fmt: skip
def test_validation_names_the_field(settings, field) -> None:
    with pytest.raises(ConfigError) as err:
        ThrottleSpec.from_mapping(settings)
    assert err.value.field == field and str(err.value).startswith(field)
    if isinstance(settings, dict):
        with pytest.raises(ConfigError) as err:
            StoreConfig.from_mapping({"devices": ["/a"], "throttle": settings})
        assert err.value.field == field


def test_valid_settings() -> None:
    assert ThrottleSpec.from_mapping({}) == ThrottleSpec()
    s = ThrottleSpec.from_mapping({"read_bytes_per_s": 50e6, "write_bytes_per_s": 200_000_000, "latency_s": 0})
    assert s == ThrottleSpec(50e6, 200e6, 0.0)
    cfg = StoreConfig.from_mapping({"devices": ["/a"], "throttle": {"latency_s": 0.002}})
    assert cfg.throttle == {"latency_s": 0.002}
    assert cfg.throttle_spec() == ThrottleSpec(latency_s=0.002)
    assert StoreConfig.from_mapping({"devices": ["/a"]}).throttle_spec() is None


@pytest.mark.parametrize("kwargs, field", [
    ({"read_bytes_per_s": 0.0}, "throttle.read_bytes_per_s"),
    ({"write_bytes_per_s": -1.0}, "throttle.write_bytes_per_s"),
    ({"latency_s": 61.0}, "throttle.latency_s"),
])  # fmt: skip
def test_a_spec_built_directly_is_validated_too(kwargs, field) -> None:
    with pytest.raises(ConfigError) as err:
        ThrottleSpec(**kwargs)
    assert err.value.field == field


def test_transfer_time_by_kind() -> None:
    spec = ThrottleSpec(read_bytes_per_s=1e6)
    assert transfer_s(spec, OpKind.READ, 250_000) == pytest.approx(0.25)
    assert transfer_s(spec, OpKind.WRITE, 250_000) == 0.0  # uncapped writes


def test_wrapped_engine_results_pass_through() -> None:
    inner = ThreadPoolEngine(4)
    eng = ThrottledEngine(inner, ThrottleSpec(latency_s=0.0))
    res = eng.run([IOOp(OpKind.READ, 999_999, 0, [memoryview(bytearray(4096))])])
    assert not res[0].ok and res[0].error is not None  # a bad fd fails as it does unthrottled
    eng.close()


def test_page_store_with_throttle_moves_correct_bytes(tmp_path) -> None:
    mem = HostMemory(8)
    latency_s = 0.02
    store = open_store(tmp_path, throttle={"read_bytes_per_s": 64 << 20, "write_bytes_per_s": 64 << 20,
                                           "latency_s": latency_s})
    try:
        assert store._engine.name.startswith("throttled(")
        data = [mem.fill(i, seed=i) for i in range(4)]
        assert store.put([key(i) for i in range(4)], [mem.runs(i) for i in range(4)]) == [True] * 4
        mem.clear()
        t0 = time.monotonic()
        assert store.get([key(i) for i in range(4)], [mem.runs(4 + i) for i in range(4)]) == [True] * 4
        # The throttle was in the store's path: no read returns before its emulated latency. (Whether run()
        # also had to sleep depends on how long the real IO took, so waited_s is no evidence either way.)
        assert time.monotonic() - t0 >= latency_s
        assert [mem.page(4 + i).tobytes() for i in range(4)] == data
    finally:
        store.close()
