"""Reliability and security on a real SGLang server (CPU) with KVTierStorage.

One server, one store with a seeded fault-injecting IO engine whose knobs a control file sets live:
  * cache_salt: requests with different salts never hit each other's pages (SGLang seeds its hash chain
    with the salt; our store never sees the salt, only different keys);
  * a sick device: injected read errors make loads fail; every request still gets the right answer
    (recompute), no exception reaches SGLang, the circuit opens, and hits resume once the device heals;
  * the admin clear endpoint needs SGLang's --admin-api-key and empties our store.
A second server runs under SGLang's own fault injector (random delays and failures in every backend call).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from stream_server_kit import FaultControl  # noqa: E402

from sgl_kvtier.admin.fsck import find_shards, shard_summary  # noqa: E402
from sgl_kvtier.serving.launch import BACKEND  # noqa: E402
from sgl_kvtier.serving.model_factory import make_model, make_prompt  # noqa: E402
from sgl_kvtier.serving.server import SGLangServer, cached_tiers, tracebacks_through  # noqa: E402

pytestmark = pytest.mark.server  # starts real SGLang servers

PAGE = 16
ADMIN_KEY = "test-admin-key"
COOLDOWN_S = 6.0  # the sick request's last reads, a flush and the next request fit in it on a loaded machine


def args_for(store: Path, control: Path | None = None) -> list[str]:
    extra = {**BACKEND, "devices": [str(store)], "capacity_bytes": 256 << 20, "prefetch_threshold": 64,
             "breaker_failures": 1, "breaker_cooldown_s": COOLDOWN_S, "slow_io_s": 0.5}
    if control is not None:
        extra["fault_injection"] = {"seed": 11, "control_file": str(control)}
    args = [
        "--max-total-tokens", "16384", "--hicache-ratio", "2",
        "--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
        "--page-size", str(PAGE), "--enable-cache-report", "--enable-metrics", "--skip-server-warmup",
        "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra),
    ]  # fmt: skip
    return args


def storage_hit(out: dict) -> int:
    return cached_tiers(out)["storage"]


def backed_up(srv: SGLangServer) -> float:
    return srv.metric("sglang:backuped_tokens_total")


def settle(srv: SGLangServer, before: float, tokens: int) -> float:
    """Wait until ``tokens`` more tokens reached L3, then flush L1 and L2."""
    value = srv.wait_metric("sglang:backuped_tokens_total", before + tokens, timeout_s=180)
    srv.flush_cache()
    return value


def test_salts_faults_and_admin_clear(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", "tiny")
    store, control = tmp_path / "flash", tmp_path / "faults.json"
    store.mkdir()
    faults_file = FaultControl(control)  # atomic renames, a new mtime each time: the engine sees every change
    prompt = make_prompt(600, seed=5, model_dir=model)
    hit = (600 - 1) // PAGE * PAGE
    with SGLangServer(model, extra_args=args_for(store, control), log_path=tmp_path / "s.log",
                      admin_api_key=ADMIN_KEY) as srv:
        # cache_salt isolation, end to end.
        a_cold = srv.generate(prompt, cache_salt="tenant-a")
        settle(srv, 0, hit)
        b = srv.generate(prompt, cache_salt="tenant-b")
        assert storage_hit(b) == 0 and b["meta_info"]["cached_tokens"] == 0
        settle(srv, hit, hit)
        a_warm = srv.generate(prompt, cache_salt="tenant-a")
        assert storage_hit(a_warm) == hit and a_warm["output_ids"] == a_cold["output_ids"]
        srv.flush_cache()

        # Sick devices: failing reads, a vanished device, multi-second stalls. Every answer stays right
        # (computed instead of loaded); the circuit opens on the first bad load; hits resume after healing.
        timings = {}
        for name, faults in (("eio", {"read_error_rate": 1.0}), ("gone", {"down": [0]}),
                             ("stall", {"stall_rate": 1.0, "stall_s": 1.5})):
            faults_file.set(**faults)
            srv.flush_cache()
            sick = srv.generate(prompt, cache_salt="tenant-a")
            assert sick["output_ids"] == a_cold["output_ids"], name
            srv.flush_cache()
            opened = time.monotonic()
            again = srv.generate(prompt, cache_salt="tenant-a")  # circuit open: no IO, a plain miss
            assert again["output_ids"] == a_cold["output_ids"] and storage_hit(again) == 0, name
            faults_file.set()  # the device heals; after the cool-down a probe succeeds
            healed = None
            while time.monotonic() < opened + COOLDOWN_S + 120:
                srv.flush_cache()
                healed = srv.generate(prompt, cache_salt="tenant-a")
                if storage_hit(healed) == hit:
                    break
            assert healed is not None and storage_hit(healed) == hit, name
            assert healed["output_ids"] == a_cold["output_ids"], name
            timings[name] = time.monotonic() - opened
        # A full device: writes fail with ENOSPC; new prompts are still answered.
        faults_file.set(enospc_rate=1.0)
        fresh = make_prompt(500, seed=6, model_dir=model)
        assert srv.generate(fresh)["output_ids"] == srv.generate(fresh)["output_ids"]
        faults_file.set()

        # Admin clear: refused without the admin key, done with it.
        status, _ = srv.request("POST", "/hicache/storage-backend/clear", headers={})
        assert status in (401, 403)
        assert shard_summary(find_shards(str(store))[0])["pages"] > 0
        status, _ = srv.request("POST", "/hicache/storage-backend/clear")  # with the admin key
        assert status == 200
        srv.flush_cache()
        cleared = srv.generate(prompt, cache_salt="tenant-a")
        assert storage_hit(cleared) == 0
        log = (tmp_path / "s.log").read_text(errors="replace")
    assert tracebacks_through(log) == []
    assert "circuit open" in log and "circuit closed: device recovered" in log
    print("device faults: degraded on the first bad load; from the open circuit to hits resuming: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))


def test_sglang_own_fault_injector(tmp_path: Path) -> None:
    """SGLANG_TEST_HICACHE_BACKEND_RANDOM_{DELAY,FAILURE} wrap our backend; answers stay right."""
    model = make_model(tmp_path / "model", "tiny")
    store = tmp_path / "flash"
    store.mkdir()
    prompts = [make_prompt(400 + 48 * i, seed=20 + i, model_dir=model) for i in range(4)]
    env = {"SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.3", "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY": "0.05"}
    with SGLangServer(model, extra_args=args_for(store), env=env, log_path=tmp_path / "s.log") as srv:
        cold = [srv.generate(p) for p in prompts]
        srv.flush_cache()
        warm = [srv.generate(p) for p in prompts]
        log = (tmp_path / "s.log").read_text(errors="replace")
    assert [w["output_ids"] for w in warm] == [c["output_ids"] for c in cold]
    assert tracebacks_through(log) == []
    assert "FailureInjector" in log or "failure" in log.lower()
