"""End to end on a real SGLang 0.5.23 server (CPU route): a prompt served from L3 after a flush.

This is the proof that the CPU plugin works in SGLang's spawned scheduler: without its shims the
server cannot build the host pool or copy KV between device and host. It uses SGLang's built-in
`file` backend so that it does not depend on our store. It runs twice, on a bfloat16 and a float32 model
made by the factory (the dtype `auto` picks on CPUs with and without AVX512-BF16/AMX; the runner serves a
factory model with its own `--dtype`, where SGLang's `--dtype auto` would make float32 float16), and each
takes about a minute: server start-up dominates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from sgl_kvtier.serving.hardware import DTYPE_BYTES  # noqa: E402
from sgl_kvtier.serving.model_factory import make_model, make_prompt, spec_for  # noqa: E402
from sgl_kvtier.serving.server import SGLangServer  # noqa: E402

pytestmark = pytest.mark.server  # starts real SGLang servers

PAGE = 16
BACKED_UP = "sglang:backuped_tokens_total"


def expected_storage_hit(prompt_len: int) -> int:
    """Tokens SGLang 0.5.23 can take from L3 when the whole prompt is stored there.

    The prefix match is capped at prompt_len - 1, so the last token is always computed and yields
    logits (`Req._compute_max_prefix_len`). L3 holds whole pages only, so the hit is then rounded
    down to a page: 900 -> 896 (56 pages; the 4-token tail was never a whole page), and an exact
    multiple like 896 -> 880, because the cap of 895 tokens cuts into the 56th page.
    """
    return (prompt_len - 1) // PAGE * PAGE


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_flushed_prompt_is_served_from_l3_with_identical_greedy_output(tmp_path: Path, dtype: str) -> None:
    model = make_model(tmp_path / "model", "tiny", dtype=dtype)
    page_bytes = PAGE * spec_for("tiny", dtype).kv_bytes_per_token(DTYPE_BYTES[dtype])
    l3 = tmp_path / "l3"
    prompts = {n: make_prompt(n, seed=n, model_dir=model) for n in (900, 896)}
    args = [
        # CPU: bound the "device" KV pool, or it takes most of the RAM and leaves none for HiCache.
        "--max-total-tokens", "16384", "--hicache-ratio", "2",
        "--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
        "--page-size", str(PAGE), "--enable-cache-report", "--enable-metrics",
        "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": str(l3)}),
        # No warm-up request: then every token written to L3 is ours and the counts below are exact.
        "--skip-server-warmup",
    ]  # fmt: skip
    with SGLangServer(model, extra_args=args, log_path=tmp_path / "server.log") as srv:
        # SGLang's own post-warm-up /freeze_gc races its HTTP server under --skip-server-warmup; the runner's
        # is sent once /health answers.
        assert srv.gc_frozen is True
        cold = {n: srv.generate(p, max_new_tokens=8, temperature=0.0) for n, p in prompts.items()}
        for n, out in cold.items():
            assert out["meta_info"]["prompt_tokens"] == n
            assert out["meta_info"]["cached_tokens"] == 0
        # Every prompt here is exactly 56 whole pages (+ a partial one for 900) and the 7 decoded
        # tokens with KV never complete a page, so 2 x 896 tokens go to L3. Waiting for them also
        # lets the first-ever JIT build of SGLang's hash extension finish before the flush: a flush
        # joins the storage threads with a 10 s timeout and kills the scheduler if one is busy.
        assert srv.wait_metric(BACKED_UP, 2 * 896, timeout_s=180) == 2 * 896
        assert len(list(l3.iterdir())) == 2 * 56
        # Each file is one page's K and V in the model's dtype: the server ran in it (not float16, not bf16).
        assert {f.stat().st_size for f in l3.iterdir()} == {page_bytes}
        assert srv.command[srv.command.index("--dtype") + 1] == dtype
        srv.flush_cache()
        warm = {n: srv.generate(p, max_new_tokens=8, temperature=0.0) for n, p in prompts.items()}
        log = (tmp_path / "server.log").read_text(errors="replace")

    for n in prompts:
        hit = expected_storage_hit(n)
        meta = warm[n]["meta_info"]
        assert meta["cached_tokens"] == hit, meta
        assert meta["cached_tokens_details"] == {
            "device": 0,
            "host": 0,
            "storage": hit,
            "storage_backend": "HiCacheFile",
        }
        assert warm[n]["output_ids"] == cold[n]["output_ids"]
        assert warm[n]["text"] == cold[n]["text"]
    assert (expected_storage_hit(900), expected_storage_hit(896)) == (896, 880)
    # The greedy continuation depends on the prompt, so equality above is not vacuous.
    assert cold[900]["output_ids"] != cold[896]["output_ids"]
    # The shims ran inside the scheduler subprocess, not just in the launcher.
    assert "sgl_kvtier cpu shim: HostKVCache(pool_label=kv) allocated with pin_memory=False" in log
    assert "sgl_kvtier cpu shim: torch transfer_kv_direct in use" in log
