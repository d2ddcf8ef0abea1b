"""Per-device read figures come from each device's own ops, the total from the batch's wall clock.

A wrapper engine reports every op on one device as slower than it was (``IOResult.seconds``, what an
engine measures per op); nothing sleeps, so the batch's wall clock stays that of the real, fast reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from support import PAGE_BYTES, HostMemory, key, namespace, store_config

from sgl_kvtier.io.engine import IOOp, IOResult, ThreadPoolEngine
from sgl_kvtier.store import PageStore
from sgl_kvtier.store.transfer import busy_seconds

SLOW_OP_S = 0.05  # reported per op on the slow device: far above a real 16 KiB read from the page cache


class SlowDevice:
    """Passes ops to ``inner``; the ops of ``device`` report ``extra_s`` more than they took."""

    def __init__(self, inner: ThreadPoolEngine, device: int, extra_s: float):
        self.inner, self.device, self.extra_s = inner, device, extra_s
        self.name = f"slow({inner.name})"

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        results = self.inner.run(ops)
        for op, res in zip(ops, results):
            if op.device == self.device:
                res.seconds += self.extra_s
        return results

    def close(self) -> None:
        self.inner.close()


def test_a_slow_device_reads_slower_than_a_fast_one_in_the_same_batch(tmp_path):
    devs = [tmp_path / "d0", tmp_path / "d1"]
    for d in devs:
        d.mkdir()
    pages = 32
    mem = HostMemory(pages)
    cfg = store_config(tmp_path, capacity_pages=pages, devices=devs, io_depth=8)
    engine = SlowDevice(ThreadPoolEngine(8), device=1, extra_s=SLOW_OP_S)
    with PageStore.open(cfg, namespace(), engine=engine) as store:
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
