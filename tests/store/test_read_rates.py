"""The store's read figures: estimators on synthetic samples, and per-device figures from each device's own
ops, the total from the batch's wall clock.

A wrapper engine reports every op on one device as slower than it was (``IOResult.seconds``, what an
engine measures per op); nothing sleeps, so the batch's wall clock stays that of the real, fast reads.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from support import PAGE_BYTES, EngineWrapper, HostMemory, key, namespace, store_config

from sgl_kvtier.io.engine import IOOp, IOResult
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.store.read_rates import ReadRates, TransferEstimator
from sgl_kvtier.store.transfer import busy_seconds

PB = 4 << 20  # 4 MiB pages (a large model's KV per page)
SLOW_OP_S = 0.05  # reported per op on the slow device: far above a real 16 KiB read from the page cache


class SlowDevice(EngineWrapper):
    """The ops of ``device`` report ``extra_s`` more than they took."""

    def __init__(self, depth: int, device: int, extra_s: float):
        super().__init__(depth)
        self.device, self.extra_s = device, extra_s
        self.name = f"slow({self.inner.name})"

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        results = self.inner.run(ops)
        for op, res in zip(ops, results):
            if op.device == self.device:
                res.seconds += self.extra_s
        return results


def test_a_slow_device_reads_slower_than_a_fast_one_in_the_same_batch(tmp_path):
    devs = [tmp_path / "d0", tmp_path / "d1"]
    for d in devs:
        d.mkdir()
    pages = 32
    mem = HostMemory(pages)
    cfg = store_config(tmp_path, capacity_pages=pages, devices=devs, io_depth=8)
    engine = SlowDevice(8, device=1, extra_s=SLOW_OP_S)
    with open_writer(cfg, namespace(), engine=engine) as store:
        keys = [key(i) for i in range(pages)]
        for i in range(pages):
            mem.fill(i, i)
        assert store.put(keys, [mem.runs(i) for i in range(pages)]) == [True] * pages
        slow_pages = [sum(store.slot_of(k) % 2 for k in keys[:n]) for n in (8, 32)]
        assert slow_pages == [4, 16]  # striped: both devices in every batch, half each
        for n in (8, 32, 8, 32):  # two batch sizes, so bandwidth and batch latency both fit
            assert store.get(keys[:n], [mem.runs(i) for i in range(n)]) == [True] * n
        rates = store.read_rates
        fast, slow, total = rates.devices[0].model(), rates.devices[1].model(), rates.total.model()
        assert rates.devices[0].samples == rates.devices[1].samples == rates.total.samples == 4
        # The slow device's own ops: 4 pages in one wave of 50 ms, then 16 pages on its share of the 8
        # slots (4) in 4 waves: 4 pages per 50 ms, no fixed cost per batch.
        assert slow.bandwidth_Bps == pytest.approx(4 * PAGE_BYTES / SLOW_OP_S, rel=0.2)  # real op times ride on top
        assert slow.batch_latency_s < SLOW_OP_S / 5
        assert fast.bandwidth_Bps > 10 * slow.bandwidth_Bps
        # The total is on the batch's wall clock, which the reported op times did not stretch.
        assert total.bandwidth_Bps > 2 * slow.bandwidth_Bps


def test_busy_seconds_from_a_devices_own_ops():
    # All ops in flight at once: a device's busy time is its slowest op.
    assert busy_seconds([(0, 0.01), (1, 0.5), (0, 0.02), (1, 0.4)], ndev=2, depth=8) == [0.02, 0.5]
    # 16 ops on 4 slots, 8 per device: each device held ~2 slots, so 4 waves of its ops.
    ops = [(i % 2, 0.1 if i % 2 else 0.01) for i in range(16)]
    assert busy_seconds(ops, ndev=2, depth=4) == pytest.approx([0.04, 0.4])
    # No ops, or an engine that measures nothing: 0.0 (the caller falls back to the batch's clock).
    assert busy_seconds([(0, 0.0), (0, 0.0)], ndev=3, depth=4) == [0.0, 0.0, 0.0]


def test_transfer_estimator_converges_on_noisy_samples_and_tracks_a_change():
    rng = random.Random(7)
    est = TransferEstimator(half_life=32)
    assert est.model() is None
    for _ in range(400):
        pages = rng.randint(1, 128)
        est.record(pages * PB, (0.004 + pages * PB / 3e9) * rng.uniform(0.97, 1.03))
    m = est.model()
    assert m.bandwidth_Bps == pytest.approx(3e9, rel=0.05)
    assert m.batch_latency_s == pytest.approx(0.004, abs=0.002)
    for _ in range(400):  # the device degrades: a moving average follows
        pages = rng.randint(1, 128)
        est.record(pages * PB, 0.02 + pages * PB / 0.5e9)
    m = est.model()
    assert m.bandwidth_Bps == pytest.approx(0.5e9, rel=0.02)
    assert m.batch_latency_s == pytest.approx(0.02, rel=0.05)
    assert est.samples == 800


def test_transfer_estimator_with_one_transfer_size_puts_the_time_in_bandwidth():
    est = TransferEstimator()
    for _ in range(10):
        est.record(128 * PB, 0.25)
    est.record(0, 1.0)  # ignored: nothing moved
    est.record(PB, 0.0)  # ignored: no time
    m = est.model()
    assert m.batch_latency_s == 0 and m.bandwidth_Bps == pytest.approx(128 * PB / 0.25)
    assert est.samples == 10 and est.snapshot()["samples"] == 10


def test_read_rates_split_a_batch_over_devices():
    rates = ReadRates(devices=2)
    for _ in range(5):
        rates.record([0, 1, 0, 1, 0, 1], PB, 0.01)
        rates.record([0, 1, 0, 1], PB, 0.008)
    assert rates.model() is rates.total.model()
    assert rates.total.model().bandwidth_Bps == pytest.approx(PB / 0.001, rel=1e-6)  # 1 ms a page...
    assert rates.total.model().batch_latency_s == pytest.approx(0.004, rel=1e-6)  # ...after 4 ms a batch
    assert rates.devices[0].samples == rates.devices[1].samples == 10


def test_read_rates_per_device_on_their_own_busy_time():
    rates = ReadRates(devices=2)
    for _ in range(3):  # device 1 was busy 10x longer with its half of the batch; the batch took 10 ms
        rates.record([0, 1] * 8, PB, 0.01, device_seconds=[0.002, 0.02])
    assert rates.total.model().bandwidth_Bps == pytest.approx(16 * PB / 0.01)
    assert rates.devices[0].model().bandwidth_Bps == pytest.approx(8 * PB / 0.002)
    assert rates.devices[1].model().bandwidth_Bps == pytest.approx(8 * PB / 0.02)
    rates = ReadRates(devices=2)
    rates.record([0, 1], PB, 0.01, device_seconds=[0.0, 0.004])  # device 0 not timed: the batch's clock
    assert rates.devices[0].model().bandwidth_Bps == pytest.approx(PB / 0.01)
    assert rates.devices[1].model().bandwidth_Bps == pytest.approx(PB / 0.004)
