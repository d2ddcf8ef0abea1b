"""The torch stand-ins for the ``page_first_direct`` kernels (SGLang imports them only on CUDA/ROCm/XPU):
driven through SGLang's own host pools, a backup then a per-layer load gives back the device's rows, and the
host pages hold them in SGLang's ``page_first_direct`` order (``(pages, layers, page, ...)`` per K / V)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from pools import host_pool_over  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host import mha as host_mha  # noqa: E402
from sglang.srt.mem_cache.pool_host import mla as host_mla  # noqa: E402

from sgl_kvtier.sglang.plugins import cpu_shims  # noqa: E402

PAGE, LAYERS, TOKENS = 16, 3, 256


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch):
    """The stand-ins where SGLang's host pools look them up (the kernels' names, absent on CPU)."""
    for name in ("transfer_kv_all_layer_direct_lf_pf", "transfer_kv_per_layer_direct_pf_lf"):
        for module in (host_mha, host_mla):
            monkeypatch.setattr(module, name, getattr(cpu_shims, name), raising=False)


def mha_pools():
    device = MHATokenToKVPool(TOKENS, PAGE, torch.bfloat16, 2, 8, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS - 1)
    host = host_pool_over(device, PAGE, "page_first_direct")
    return device, host, [device.k_buffer, device.v_buffer], [host.k_buffer, host.v_buffer]


def mla_pools():
    device = MLATokenToKVPool(TOKENS, PAGE, torch.bfloat16, 32, 16, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS - 1)
    host = host_pool_over(device, PAGE, "page_first_direct")
    return device, host, [device.kv_buffer], [host.kv_buffer]


def pages(first: int, count: int) -> torch.Tensor:
    return torch.arange(first * PAGE, (first + count) * PAGE, dtype=torch.int64)


@pytest.mark.parametrize("make", [mha_pools, mla_pools], ids=["mha", "mla"])
def test_backup_then_per_layer_load_gives_back_the_rows_in_sglangs_order(make):
    device, host, dev_bufs, host_bufs = make()
    g = torch.Generator().manual_seed(3)
    for bufs in dev_bufs:
        for layer in bufs:
            layer.copy_(torch.randn(layer.shape, generator=g).to(layer.dtype))
    src = torch.cat([pages(5, 2), pages(1, 1)])  # scattered device pages
    dst = torch.cat([pages(2, 1), pages(7, 2)])  # scattered host pages
    host.backup_from_device_all_layer(device, dst, src, "direct")

    for kv, bufs in enumerate(dev_bufs):  # page_first_direct: host[page, layer] = one page of the layer's rows
        for layer in range(LAYERS):
            for i in range(3):
                rows = bufs[layer][src[i * PAGE:(i + 1) * PAGE]]
                stored = host_bufs[kv][int(dst[i * PAGE]) // PAGE, layer].reshape(rows.shape)
                assert torch.equal(stored, rows), (kv, layer, i)

    back = pages(10, 3)
    for bufs in dev_bufs:
        for layer in bufs:
            layer.fill_(7.0)
    originals = [[layer.clone() for layer in bufs] for bufs in dev_bufs]
    for layer in range(LAYERS):
        host.load_to_device_per_layer(device, dst, back, layer, "direct")
    for kv, bufs in enumerate(dev_bufs):
        for layer in range(LAYERS):
            for i in range(3):
                got = bufs[layer][back[i * PAGE:(i + 1) * PAGE]]
                want = host_bufs[kv][int(dst[i * PAGE]) // PAGE, layer].reshape(got.shape)
                assert torch.equal(got, want), (kv, layer, i)
            untouched = torch.ones(bufs[layer].shape[0], dtype=torch.bool)
            untouched[back] = False
            assert torch.equal(bufs[layer][untouched], originals[kv][layer][untouched])  # only its own slots


def test_a_partial_page_is_refused_with_the_reason():
    device, host, _, _ = mha_pools()
    with pytest.raises(ValueError, match="whole number of pages"):
        host.backup_from_device_all_layer(device, torch.arange(8), torch.arange(8), "direct")


def test_the_cpu_plugin_installs_them_only_where_missing(monkeypatch):
    for name in ("transfer_kv_direct", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_per_layer_direct_pf_lf"):
        for module in (host_mha, host_mla):
            monkeypatch.delattr(module, name, raising=False)
    assert cpu_shims.install_transfer_kv_direct() is True
    for module in (host_mha, host_mla):
        assert module.transfer_kv_per_layer_direct_pf_lf is cpu_shims.transfer_kv_per_layer_direct_pf_lf
    kernel = object()
    monkeypatch.setattr(host_mha, "transfer_kv_all_layer_direct_lf_pf", kernel)
    cpu_shims.install_transfer_kv_direct()
    assert host_mha.transfer_kv_all_layer_direct_lf_pf is kernel  # a real kernel is never replaced


@pytest.mark.parametrize("shape", ["one run", "three runs", "scattered", "one slot"])
def test_transfer_kv_direct_copies_exactly_the_listed_rows(shape):
    """Whatever the runs, every listed row lands and no other row changes: slice copies for a few
    contiguous stretches, index ops for scattered slots (``contiguous_runs`` says which)."""
    gen = torch.Generator().manual_seed(3)
    src = [torch.randn(64, 4, 8, generator=gen) for _ in range(2)]
    dst = [torch.randn(64, 4, 8, generator=gen) for _ in range(2)]
    si, di = {"one run": (range(8, 24), range(32, 48)),
              "three runs": ([*range(0, 4), *range(12, 20), *range(40, 44)],
                             [*range(4, 8), *range(20, 28), *range(28, 32)]),
              "scattered": ([*range(0, 64, 4)], [*range(63, -1, -4)]),
              "one slot": ([5], [60])}[shape]
    src_idx, dst_idx = torch.tensor(list(si)), torch.tensor(list(di))
    runs = cpu_shims.contiguous_runs(src_idx, dst_idx)
    assert {"one run": [(8, 32, 16)], "three runs": [(0, 4, 4), (12, 20, 8), (40, 28, 4)], "scattered": None,
            "one slot": [(5, 60, 1)]}[shape] == runs
    want = [d.clone() for d in dst]
    for s, w in zip(src, want):
        w[dst_idx] = s[src_idx]
    cpu_shims.transfer_kv_direct(src, dst, src_idx.to(torch.int32), dst_idx, page_size=1)
    assert all(torch.equal(d, w) for d, w in zip(dst, want))
