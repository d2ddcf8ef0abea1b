"""End to end: a real SGLang server (CPU) with KVTierStorage as its L3 tier, on the SGLang installed here
(0.5.23 in the main run; the oldest supported release, from the built wheel, in ``test_sglang_range``).

A long prompt is answered, its pages reach our store, ``/flush_cache`` empties L1 and L2, and the same
prompt is then served from L3 with identical greedy output. Then the server is stopped and a new one is
started on the same store: the prompt hits L3 again (warm restart). The backend says which sgl-kvtier and
which SGLang it runs: the ones this environment installs. About two minutes: two start-ups.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from sgl_kvtier.admin.fsck import find_shards, fsck, shard_summary  # noqa: E402
from sgl_kvtier.serving.launch import BACKEND  # noqa: E402
from sgl_kvtier.serving.model_factory import make_model, make_prompt  # noqa: E402
from sgl_kvtier.serving.server import SGLangServer, tracebacks_through  # noqa: E402
from sgl_kvtier.sglang import release  # noqa: E402

pytestmark = pytest.mark.server  # starts real SGLang servers

PAGE = 16
PROMPT = 900
HIT = (PROMPT - 1) // PAGE * PAGE  # SGLang computes the last token; L3 holds whole pages: 896
BACKED_UP = "sglang:backuped_tokens_total"


def server_args(store: Path) -> list[str]:
    extra = {**BACKEND, "devices": [str(store)], "capacity_bytes": 256 << 20,
             "readahead_bytes": 64 << 20}  # off by default: this server (and the metrics test) stages hits
    return [
        "--max-total-tokens", "16384", "--hicache-ratio", "2",  # CPU: leave RAM for the host pool
        "--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
        "--page-size", str(PAGE), "--enable-cache-report", "--enable-metrics", "--skip-server-warmup",
        "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra),
    ]  # fmt: skip


def test_l3_hit_after_flush_and_after_restart(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", "tiny")
    store = tmp_path / "flash"
    store.mkdir()
    prompt = make_prompt(PROMPT, seed=3, model_dir=model)
    with SGLangServer(model, extra_args=server_args(store), log_path=tmp_path / "a.log") as srv:
        cold = srv.generate(prompt, max_new_tokens=8)
        assert cold["meta_info"]["cached_tokens"] == 0
        assert srv.wait_metric(BACKED_UP, HIT, timeout_s=180) == HIT
        srv.flush_cache()
        warm = srv.generate(prompt, max_new_tokens=8)
    details = warm["meta_info"]["cached_tokens_details"]
    assert details["storage"] == HIT and details["device"] == 0 and details["host"] == 0, details
    assert warm["output_ids"] == cold["output_ids"] and warm["text"] == cold["text"]

    (shard,) = find_shards(str(store))
    summary = shard_summary(shard)
    assert summary["pages"] == HIT // PAGE and "layer_first" in summary["namespace"]
    assert fsck(shard).clean

    with SGLangServer(model, extra_args=server_args(store), log_path=tmp_path / "b.log") as srv:
        restarted = srv.generate(prompt, max_new_tokens=8)
    details = restarted["meta_info"]["cached_tokens_details"]
    assert details["storage"] == HIT, details
    assert restarted["output_ids"] == cold["output_ids"]
    log = (tmp_path / "a.log").read_text(errors="replace") + (tmp_path / "b.log").read_text(errors="replace")
    # SGLang logs tracebacks of its own on CPU (e.g. /freeze_gc posted before uvicorn listens); ours: none.
    assert tracebacks_through(log) == []
    said = re.findall(r"kvtier: sgl-kvtier (\S+) \((.+?)\) on SGLang (\S+),", log)
    assert said and set(said) == {installed_here()}, said


def installed_here() -> tuple[str, str, str]:
    """(version, package directory, SGLang release) that a server started by this interpreter imports: what a
    fresh process started as the servers are (this working directory and environment) finds."""
    probe = ("import importlib.metadata as m, sgl_kvtier; "
             "print(sgl_kvtier.__version__, sgl_kvtier.__path__[0], m.version('sglang'), sep='\\n')")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    version, where, sglang = out.stdout.split("\n")[:3]
    return version, where, release.release_of(sglang)
