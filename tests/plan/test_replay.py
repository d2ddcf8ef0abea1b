"""plan.replay: the tiers' hits, the L3's reads and writes, the queue, worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from sgl_kvtier.errors import ConfigError
from sgl_kvtier.estimation import DeviceModel
from sgl_kvtier.plan.replay import (
    Deployment,
    PoolMode,
    Routing,
    break_even_tokens,
    cacheable_sizes,
    l3_pass,
    local_pass,
    peak_rate,
    timeline,
)
from sgl_kvtier.plan.trace import Trace, TraceRequest
from sgl_kvtier.policy.cost_model import PrefillModel

FAST = DeviceModel(1e18, 0.0)


def dep(**kw: object) -> Deployment:
    base: dict = {"instances": 1, "hbm_tokens": 64, "host_tokens": 128, "page_tokens": 16, "bytes_per_token": 100,
                  "array": FAST, "prefill": PrefillModel(0.01, 0.0), "h2d_Bps": 1e18, "routing": Routing.ROUND_ROBIN,
                  "prefetch_threshold_tokens": 0}
    return Deployment(**(base | kw))


TRACE = Trace((TraceRequest(0, 64, 1, (1, 2)), TraceRequest(10, 96, 1, (1, 2, 3)), TraceRequest(20, 64, 1, (4, 5)),
               TraceRequest(30, 128, 1, (1, 2, 3, 6))), 32, "hand")


def test_hbm_host_and_l3_by_hand() -> None:
    d = dep()
    sizes = cacheable_sizes(TRACE, d.page_tokens)
    hbm = local_pass(TRACE, d, sizes, host=False)
    assert hbm.device_tokens.tolist() == [0, 64, 0, 0] and not hbm.host_tokens.any()
    local = local_pass(TRACE, d, sizes)
    # r1 finds 1, 2 in HBM; r2 pushes 1..3 out of HBM and 3 out of host memory; r3 finds 1, 2 in host memory
    assert local.device_tokens.tolist() == [0, 64, 0, 0]
    assert local.host_tokens.tolist() == [0, 0, 0, 64]
    l3 = l3_pass(TRACE, d, sizes, local, 1e9, PoolMode.SHARED)
    assert l3.storage_tokens.tolist() == [0, 0, 0, 32]  # block 3, written by r1, after r3's host hits
    assert l3.written_tokens.tolist() == [64, 32, 64, 32] and l3.evicted == 0
    small = l3_pass(TRACE, d, sizes, local, 2 * 32 * 100, PoolMode.SHARED)  # two blocks of room
    assert small.storage_tokens.tolist() == [0, 0, 0, 0] and small.evicted > 0


def test_a_shared_pool_serves_what_another_instance_wrote() -> None:
    d = dep(instances=2, hbm_tokens=0, host_tokens=1)  # a host pool too small to hold a block
    sizes = cacheable_sizes(TRACE, d.page_tokens)
    local = local_pass(TRACE, d, sizes)
    assert local.instance.tolist() == [0, 1, 0, 1] and not local.host_tokens.any()
    shared = l3_pass(TRACE, d, sizes, local, 1e9, PoolMode.SHARED)
    own = l3_pass(TRACE, d, sizes, local, 1e9, PoolMode.PER_INSTANCE)
    assert shared.storage_tokens.tolist() == [0, 64, 0, 96]
    assert own.storage_tokens.tolist() == [0, 0, 0, 96]  # r3 reads what r1 wrote on instance 1


def test_cache_aware_routing_follows_the_prefix() -> None:
    d = dep(instances=2, routing=Routing.CACHE_AWARE)
    local = local_pass(TRACE, d, cacheable_sizes(TRACE, d.page_tokens))
    assert local.instance[1] == local.instance[0]  # r1 continues r0's prefix
    assert local.instance[2] != local.instance[0]  # r2 shares nothing: the less loaded instance


def test_the_queue_and_a_load_that_does_not_block_others() -> None:
    d = dep(array=DeviceModel(100 * 16 / 1.0, 0.0))  # one page a second
    trace = Trace((TraceRequest(0.0, 64, 1, (1, 2)), TraceRequest(0.1, 96, 1, (7, 8, 9))), 32, "q")
    inst = np.zeros(2, np.int64)
    tl = timeline(trace, d, inst, cached=np.array([0, 64]), loaded=np.array([0, 0]), from_host=np.array([0, 64]))
    assert tl.ttft_s.tolist() == pytest.approx([0.64, 0.64 + 0.32 - 0.1])
    # r0 waits 2 s for two pages from the L3; r1, ready first, is prefilled first
    tl = timeline(trace, d, inst, cached=np.array([32, 0]), loaded=np.array([32, 0]), from_host=np.array([0, 0]))
    assert tl.ready_s.tolist() == pytest.approx([2.0, 0.1])
    assert tl.ttft_s.tolist() == pytest.approx([2.0 + 0.32, 0.96])


def test_break_even_by_hand() -> None:
    d = dep(array=DeviceModel(1e7, 0.01), prefill=PrefillModel(1e-4, 0.0))
    # load: 0.01 per 128-page batch + 1e-5 s a token; recompute 1e-4 s a token: above 111.1 tokens, whole pages
    assert break_even_tokens(d) == 112
    assert break_even_tokens(dep(array=DeviceModel(100.0, 0.0), prefill=PrefillModel(1e-4, 0.0))) is None


def test_peak_rate() -> None:
    assert peak_rate(np.array([0.1, 0.5, 1.2, 3.0]), np.array([1.0, 2.0, 5.0, 0.0])) == 5.0
    assert peak_rate(np.array([]), np.array([])) == 0.0


@pytest.mark.parametrize(("kw", "field"), [({"instances": 0}, "instances"), ({"host_tokens": -1}, "host_tokens"),
                                           ({"array": DeviceModel(0.0, 0.0)}, "read_gbps")])
def test_bad_deployment_names_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}:"):
        dep(**kw)


def test_a_flush_empties_hbm_and_host_memory_not_the_l3() -> None:
    d = dep()
    sizes = cacheable_sizes(TRACE, d.page_tokens)
    local = local_pass(TRACE, d, sizes, flushes=[10.0])  # /flush_cache just before r1
    assert local.device_tokens.tolist() == [0, 0, 0, 0] and local.host_tokens.tolist() == [0, 0, 0, 64]
    l3 = l3_pass(TRACE, d, sizes, local, 1e9, PoolMode.SHARED)
    assert l3.storage_tokens.tolist() == [0, 64, 0, 32]  # r1 reads r0's pages from the L3


def test_sglang_skips_short_prefetches_and_those_past_half_the_host_pool() -> None:
    sizes = cacheable_sizes(TRACE, 16)
    # r3's L3 hit is one block of 32 tokens: below a threshold of 48 it is computed (and its block rewritten)
    d = dep(prefetch_threshold_tokens=48)
    local = local_pass(TRACE, d, sizes)
    assert l3_pass(TRACE, d, sizes, local, 1e9, PoolMode.SHARED).storage_tokens.tolist() == [0, 0, 0, 0]
    # two instances without HBM or host hits, a slow array: r1's load (64 tokens, 4 s) is still in flight
    # when r3 comes to the same instance, and 64 tokens are half of a 128-token host pool
    slow = DeviceModel(100 * 16 / 1.0, 0.0)  # a page a second
    trace = Trace((TraceRequest(0, 64, 1, (1, 2)), TraceRequest(0.5, 64, 1, (1, 2)), TraceRequest(1.0, 64, 1, (7, 8)),
                   TraceRequest(1.5, 64, 1, (1, 2))), 32, "rate")
    sizes = cacheable_sizes(trace, 16)
    limited = dep(instances=2, hbm_tokens=0, host_tokens=128, array=slow)
    local = local_pass(trace, limited, sizes, host=False)
    assert l3_pass(trace, limited, sizes, local, 1e9, PoolMode.SHARED).storage_tokens.tolist() == [0, 64, 0, 0]
    roomy = dep(instances=2, hbm_tokens=0, host_tokens=256, array=slow)
    assert l3_pass(trace, roomy, sizes, local, 1e9, PoolMode.SHARED).storage_tokens.tolist() == [0, 64, 0, 64]
