"""plan.planner: the rows, their invariants, and the advice on a multi-turn trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from sgl_kvtier.estimation import DeviceModel
from sgl_kvtier.plan import report
from sgl_kvtier.plan.planner import PlanResult, plan
from sgl_kvtier.plan.replay import Deployment, PoolMode, Routing
from sgl_kvtier.plan.trace import load
from sgl_kvtier.policy.cost_model import PrefillModel

BPT = 1000


def deployment(instances: int = 2, read_Bps: float = 1e10) -> Deployment:
    return Deployment(instances, hbm_tokens=2048, host_tokens=4096, page_tokens=64, bytes_per_token=BPT,
                      array=DeviceModel(read_Bps, 1e-3), prefill=PrefillModel(2e-4, 1e-5), h2d_Bps=2e10,
                      routing=Routing.CACHE_AWARE)


@pytest.fixture
def result(mooncake_trace: Path) -> PlanResult:
    sizes = [x * 512 * BPT for x in (8, 32, 128)]
    return plan(load(mooncake_trace), deployment(), sizes)


def test_rows_and_their_invariants(result: PlanResult) -> None:
    names = [r.name for r in result.rows]
    assert names[:3] == ["no reuse", "HBM", "HBM + host"] and len(names) == 3 + 3 * 2
    base = result.row("HBM + host")
    assert result.row("no reuse").hit_share == 0.0
    assert result.row("HBM").hit_share <= base.hit_share
    l3_rows = [r for r in result.rows if r.l3_bytes]
    for r in l3_rows:  # the L3 only takes what HBM and host memory miss
        assert (r.device_share, r.host_share) == (base.device_share, base.host_share)
        assert r.written_bytes > 0 and r.write_Bpd > 0
    shared = [r for r in l3_rows if r.mode == PoolMode.SHARED.value]
    own = [r for r in l3_rows if r.mode == PoolMode.PER_INSTANCE.value]
    assert [r.storage_share for r in shared] == sorted(r.storage_share for r in shared)
    assert shared[-1].storage_share > 0.2 and shared[-1].evicted_blocks == 0
    assert all(s.storage_share >= o.storage_share for s, o in zip(shared, own))  # one pool holds more reuse
    assert shared[-1].ttft_p50_s < base.ttft_p50_s
    assert shared[-1].read_bytes == pytest.approx(shared[-1].storage_share * result.trace["input_tokens"] * BPT)
    assert result.break_even_tokens is not None
    assert sum(result.storage_over_time["storage"]) == pytest.approx(shared[-1].read_bytes / BPT)


def test_one_instance_per_instance_equals_shared(mooncake_trace: Path) -> None:
    res = plan(load(mooncake_trace), deployment(instances=1), [64 * 512 * BPT])
    a, b = (r for r in res.rows if r.l3_bytes)
    assert (a.storage_share, a.ttft_p50_s, a.written_bytes) == (b.storage_share, b.ttft_p50_s, b.written_bytes)


def test_advice_names_a_size_or_says_it_does_not_pay(result: PlanResult, mooncake_trace: Path) -> None:
    text = report.advice(result)
    assert text.startswith("Take ") and "of shared L3" in text and "Loading beats recomputing from" in text
    slow = plan(load(mooncake_trace), deployment(read_Bps=1e5), [128 * 512 * BPT])
    assert report.advice(slow).startswith("Offload does not pay for this trace")
    md = report.markdown(result)
    assert md.count("\n") == 2 + len(result.rows) and "L3 read GB/s" in md


def test_plot(result: PlanResult, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = report.plot(result, tmp_path / "p.png", "caption")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_forked_passes_give_the_same_rows(mooncake_trace: Path, result: PlanResult) -> None:
    sizes = [x * 512 * BPT for x in (8, 32, 128)]
    seen: list[str] = []
    forked = plan(load(mooncake_trace), deployment(), sizes, workers=2, progress=seen.append)
    assert forked.rows == result.rows
    assert sorted(seen) == sorted(["HBM + host", "HBM"] + [r.name for r in result.rows[3:]])
