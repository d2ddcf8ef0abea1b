"""benchmarks.bench_backends: a small run (128 pages of 256 KiB, one round) of SGLang's ``file`` backend and
ours with ``--readahead``: kvtier's exists -> get span with read-ahead on (256 MiB) and off."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from benchmarks import bench_backends  # noqa: E402
from benchmarks.store.load import READAHEAD_ON  # noqa: E402


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_small_run_with_readahead(tmp_path: Path) -> None:
    out = tmp_path / "bench_backends.json"
    bench_backends.main(["--page-mib", "0.25", "--total-gib", "0.01", "--rounds", "1", "--exists-keys", "64",
                         "--exists-repeats", "2", "--readahead", "--dir", str(tmp_path / "scratch"),
                         "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    rows = {(r["system"], r["op"]): r for r in result["rows"]}
    cold = "cold" if result["cold_reads"] else "WARM"
    assert set(rows) == {(s, op) for s in ("file", "kvtier") for op in ("put", "get", "exists cold", "exists warm")} \
        | {("fio", "put"), ("fio", "get"), ("kvtier", "load"), ("kvtier+ra", "load")}
    on, off = rows[("kvtier+ra", "load")], rows[("kvtier", "load")]
    assert on["metric"] == f"kvtier+ra load {cold} 0.25 MiB" and on["value"] > 0 and off["value"] > 0
    assert on["vs_ra_off"] == pytest.approx(on["value"] / off["value"]) and off["vs_ra_off"] is None
    assert on["vs_fio"] == pytest.approx(on["value"] / rows[("fio", "get")]["value"])
    # The whole 32 MiB span fits the default 256 MiB budget: every page is staged by exists, and served.
    assert f"readahead_bytes={READAHEAD_ON};" in on["note"] and "staged 128" in on["note"]
    assert "served 128" in on["note"]
    assert off["note"].startswith("readahead_bytes=0;") and "staged" not in off["note"]
    assert rows[("kvtier", "get")]["vs_file"] > 0 and "verified byte-exact" in rows[("kvtier", "get")]["note"]
    # auto: the machine's native KV dtype (bench_backends asks nvidia-smi: a GPU machine keeps bfloat16).
    from sgl_kvtier.serving.hardware import choose_dtype

    assert result["machine"]["model_dtype"] == choose_dtype().dtype == result["args"]["kv_dtype"]
    assert result["machine"]["model_dtype_source"] == choose_dtype().describe()


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
def test_host_pool_pages_are_the_same_bytes_in_every_dtype(layout: str) -> None:
    import torch

    from benchmarks.store.backends import LAYER_BYTES, host_pool, kv_heads, page_equal

    sizes = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        pool = host_pool(0.5, layout, 4, dtype)  # two layers of 256 KiB
        page = pool.get_data_page(0, flat=True)
        assert pool.dtype == dtype and kv_heads(dtype) * dtype.itemsize == 16
        sizes[dtype] = page.numel() * page.element_size()
        assert page_equal(pool, 1, 1) and not page_equal(pool, 1, 2)  # random bytes, compared bit for bit
    assert set(sizes.values()) == {2 * LAYER_BYTES}
