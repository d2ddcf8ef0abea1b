"""The CPU extend-attention shim (new queries only) gives SGLang's own torch_native rows, for every prefix."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402

from sgl_kvtier.sglang.plugins import cpu_shims  # noqa: E402
from sgl_kvtier.sglang.plugins.cpu_shims import extend_attention_new_queries_only  # noqa: E402


def sglang_own():
    """SGLang's own extend attention, unwrapped: once the CPU plugin's hook is applied (the session fixture
    of other tests in this process), the class holds the wrapper, and HookRegistry also rebinds every module
    global that held the original, so it is never kept in one here."""
    fn = TorchNativeAttnBackend.__dict__["_run_sdpa_forward_extend"]
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


HEADS, KV_HEADS, DIM = 4, 2, 32


def batch(prefixes: list[int], news: list[int], seed: int = 0):
    """Token slots for several requests (scattered through the cache), their KV, and the new tokens' queries."""
    g = torch.Generator().manual_seed(seed)
    totals = [p + n for p, n in zip(prefixes, news)]
    slots = torch.randperm(sum(totals) + 50, generator=g)[:sum(totals)]
    req_to_token = torch.zeros(len(totals), max(totals), dtype=torch.int64)
    at = 0
    for r, total in enumerate(totals):
        req_to_token[r, :total] = slots[at:at + total]
        at += total
    cache = sum(totals) + 50
    k = torch.randn(cache, KV_HEADS, DIM, generator=g, dtype=torch.float32)
    v = torch.randn(cache, KV_HEADS, DIM, generator=g, dtype=torch.float32)
    q = torch.randn(sum(news), HEADS, DIM, generator=g, dtype=torch.float32)
    lens = dict(req_pool_indices=torch.arange(len(totals)), seq_lens=torch.tensor(totals),
                extend_prefix_lens=torch.tensor(prefixes), extend_seq_lens=torch.tensor(news))
    return q, k, v, req_to_token, lens


def run(fn, q, k, v, req_to_token, lens, **kw):
    out = torch.empty_like(q)
    args = (q, out, k, v, req_to_token, lens["req_pool_indices"], lens["seq_lens"], lens["extend_prefix_lens"],
            lens["extend_seq_lens"], None)
    return fn(*args, scaling=DIM ** -0.5, enable_gqa=True, causal=True, is_cross_attn=False, **kw).clone()


@pytest.mark.parametrize("prefixes,news", [([0], [7]), ([48], [16]), ([0, 33, 160], [5, 1, 40]), ([100], [1])])
def test_same_rows_as_sglangs_extend_attention(prefixes, news):
    q, k, v, req_to_token, lens = batch(prefixes, news)
    want = run(lambda *a, **kw: sglang_own()(None, *a, **kw), q, k, v, req_to_token, lens)
    got = run(lambda *a, **kw: extend_attention_new_queries_only(sglang_own(), None, *a, **kw), q, k, v, req_to_token, lens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sliding_windows_go_to_sglangs_own():
    calls = []

    def original(backend, *args, **kwargs):
        calls.append(kwargs["sliding_window_size"])
        return sglang_own()(backend, *args, **kwargs)

    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)  # only its mask helper is used
    q, k, v, req_to_token, lens = batch([20], [4])
    want = run(lambda *a, **kw: sglang_own()(backend, *a, **kw), q, k, v, req_to_token, lens, sliding_window_size=8)
    got = run(lambda *a, **kw: extend_attention_new_queries_only(original, backend, *a, **kw), q, k, v,
              req_to_token, lens, sliding_window_size=8)
    assert calls == [8]
    torch.testing.assert_close(got, want)


def test_a_failing_shim_falls_back_to_sglangs_own_counted_and_logged_with_its_traceback(monkeypatch, caplog):
    def bug(*args, **kwargs):
        raise IndexError("injected bug in the shim")

    monkeypatch.setattr(cpu_shims, "_new_queries_only", bug)
    before = cpu_shims.BOUNDARY.counts()
    q, k, v, req_to_token, lens = batch([48], [16])
    want = run(lambda *a, **kw: sglang_own()(None, *a, **kw), q, k, v, req_to_token, lens)
    got = run(lambda *a, **kw: extend_attention_new_queries_only(sglang_own(), None, *a, **kw), q, k, v, req_to_token, lens)
    torch.testing.assert_close(got, want)  # SGLang's own rows: the forward never saw the exception
    after = cpu_shims.BOUNDARY.counts()
    assert (after.unexpected, after.expected) == (before.unexpected + 1, before.expected)
    [record] = [r for r in caplog.records if "injected bug in the shim" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is IndexError

