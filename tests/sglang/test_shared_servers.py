"""Real SGLang 0.5.23 servers (CPU, tiny random models) sharing one kvtier store (``sharing = "host"``).

* Two servers of the same model on one store: B is served from storage a prompt only A saw, with A's greedy
  output; then A is SIGKILLed while its backups are being written, and B still answers every prompt exactly
  as A computed it cold, with no error at its boundary.
* ``--dp-size 2``: both replicas start on one namespace (one writer each), and a prompt one replica wrote is
  a storage hit on the other (requests are routed with ``routed_dp_rank``).
* The same ``--served-model-name`` over other weights (another seed): another namespace (the weights'
  fingerprint differs), so no storage hit.

Page 16, 900-token prompts: ``HIT = 896`` tokens per prompt. Servers of one test start concurrently, each
with ``OMP_NUM_THREADS=1`` (2 cores). Writes are throttled (``throttle.write_bytes_per_s``) so that a backup
op lasts seconds and "mid-backup" is a state the test can see: ``sglang:backuped_tokens_total`` counts
whole ops, and four ops are queued when A dies. A few minutes in all: server start-ups dominate.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

from sgl_kvtier.serving.hardware import DTYPE_BYTES, choose_dtype  # noqa: E402
from sgl_kvtier.serving.launch import BACKEND  # noqa: E402
from sgl_kvtier.serving.model_factory import make_model, make_prompt, spec_for  # noqa: E402
from sgl_kvtier.serving.server import ServerError, SGLangServer, cached_tiers, tracebacks_through  # noqa: E402

pytestmark = pytest.mark.server  # starts real SGLang servers

PAGE = 16
PROMPT = 900
HIT = (PROMPT - 1) // PAGE * PAGE  # the last token is always computed; L3 holds whole pages: 896
PAGES_PER_PROMPT = HIT // PAGE
BACKED_UP = "sglang:backuped_tokens_total"
OP_SECONDS = 3.0  # one prompt's backup op under the write throttle
BOUNDARY_FAILURE = re.compile(r"kvtier \S+ failed \(")
POOL_LINE = re.compile(r"kvtier: pool kv -> (ns-[0-9a-f]+) \((\S+) weights=(\S+) ")


def page_bytes() -> int:
    dtype = choose_dtype().dtype  # what make_model(..., "tiny") serves in on this machine
    return PAGE * spec_for("tiny", dtype).kv_bytes_per_token(DTYPE_BYTES[dtype])


def args_for(store: Path, *more: str, throttle: bool = True) -> list[str]:
    extra: dict[str, Any] = {**BACKEND, "devices": [str(store)], "capacity_bytes": 256 << 20, "sharing": "host"}
    if throttle:  # one op's IOs then take seconds each: not slow enough to trip the circuit breaker
        extra.update(throttle={"write_bytes_per_s": PAGES_PER_PROMPT * page_bytes() / OP_SECONDS}, slow_io_s=600.0)
    return server_args(extra, *more)


def server_args(extra: dict[str, Any], *more: str) -> list[str]:
    """The flags of every server here: HiCache with the kvtier backend configured by ``extra``, page 16,
    cache reports and metrics; ``more`` after them."""
    return [
        "--max-total-tokens", "16384", "--hicache-ratio", "2",
        "--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
        "--page-size", str(PAGE), "--enable-cache-report", "--enable-metrics", "--skip-server-warmup",
        "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra),
        *more,
    ]  # fmt: skip


def server(model: Path, args: list[str], log: Path, **env: str) -> SGLangServer:
    return SGLangServer(model, extra_args=args, env={"OMP_NUM_THREADS": "1", **env}, log_path=log)


@contextlib.contextmanager
def running(*servers: SGLangServer) -> Iterator[tuple[SGLangServer, ...]]:
    """Start ``servers`` concurrently (each must become healthy); stop them all at the end."""
    with contextlib.ExitStack() as stack:
        for srv in servers:
            stack.callback(srv.stop)
        with ThreadPoolExecutor(len(servers)) as pool:
            for started in [pool.submit(srv.start) for srv in servers]:
                started.result()
        yield servers


def details(out: dict[str, Any]) -> dict[str, Any]:
    return dict(out["meta_info"].get("cached_tokens_details") or {})


def storage(out: dict[str, Any]) -> int:
    return cached_tiers(out)["storage"]


def generate_on(srv: SGLangServer, text: str, dp_rank: int) -> dict[str, Any]:
    """/generate routed to one DP replica (SGLang's ``routed_dp_rank``)."""
    body = {"text": text, "routed_dp_rank": dp_rank, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
    status, raw = srv.request("POST", "/generate", body)
    if status != 200:
        raise ServerError(f"/generate answered {status}: {raw[:500]!r}")
    out: dict[str, Any] = json.loads(raw)
    return out


def why_no_hit(srv: SGLangServer, log: Path) -> str:
    """What a failed storage-hit assertion shows: the server's prefetch and pool figures, its kvtier log."""
    status, raw = srv.request("GET", "/metrics")
    figures = [line for line in raw.decode(errors="replace").splitlines()
               if not line.startswith("#") and ("prefetch" in line or "kvtier_pool" in line or "kvtier_writer" in line)]
    # Ours, SGLang's prefetch outcomes, and its page-hash extension's load (a first lookup's deadline).
    marks = ("kvtier", "hicache prefetch", "extension")
    kvtier = [line[:300] for line in read(log).splitlines() if any(m in line.lower() for m in marks)]
    return "\n".join([f"/metrics {status}:", *figures, "log:", *kvtier[-40:]])


def read(log: Path) -> str:
    return log.read_text(errors="replace")


def test_two_servers_share_one_store_and_a_killed_writer_leaves_the_other_correct(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", "tiny")
    store = tmp_path / "flash"
    store.mkdir()
    p = make_prompt(PROMPT, seed=3, model_dir=model)
    qs = [make_prompt(PROMPT, seed=40 + i, model_dir=model) for i in range(4)]
    logs = tmp_path / "a.log", tmp_path / "b.log"
    with running(server(model, args_for(store), logs[0]), server(model, args_for(store), logs[1])) as (a, b):
        # (a) B never saw P: it is served from A's pages, with A's greedy output.
        a_cold = a.generate(p)
        assert storage(a_cold) == 0 and a_cold["meta_info"]["cached_tokens"] == 0
        assert a.wait_metric(BACKED_UP, HIT, timeout_s=180) == HIT
        b_warm = b.generate(p)
        assert details(b_warm) == {**details(b_warm), "device": 0, "host": 0, "storage": HIT}, why_no_hit(b, logs[1])
        assert b_warm["output_ids"] == a_cold["output_ids"] and b_warm["text"] == a_cold["text"]

        # (d) A dies while it writes: four backup ops queued, at least one done, not all.
        cold = [a.generate(q) for q in qs]
        seen = a.wait_metric(BACKED_UP, 2 * HIT, timeout_s=180)
        assert a.proc is not None
        os.killpg(a.proc.pid, signal.SIGKILL)
        a.proc.wait(timeout=30)
        assert HIT * 2 <= seen < HIT * 5, seen  # P's op and Q1's were acknowledged; at most 3 of Q's were
        warm = [b.generate(q) for q in qs]
        assert [w["output_ids"] for w in warm] == [c["output_ids"] for c in cold]
        hits = [storage(w) for w in warm]
        assert all(0 <= h <= HIT and h % PAGE == 0 for h in hits), hits
        assert max(hits) == HIT, hits  # what A acknowledged before it died is there, whole
        print(f"A killed at {seen:.0f} backed-up tokens; B's storage hits on A's four prompts: {hits}")
        b_log = read(logs[1])
    assert tracebacks_through(b_log) == [] and not BOUNDARY_FAILURE.search(b_log)
    assert tracebacks_through(read(logs[0])) == []


def test_dp_replicas_start_on_one_store_and_hit_each_others_pages(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", "tiny")
    store = tmp_path / "flash"
    store.mkdir()
    p = make_prompt(PROMPT, seed=7, model_dir=model)
    log = tmp_path / "dp.log"
    # One core per replica: SGLang on CPU binds each rank's threads, one NUMA node per rank by default.
    dp = server(model, args_for(store, "--dp-size", "2", throttle=False), log, SGLANG_CPU_OMP_THREADS_BIND="0|1")
    with running(dp) as (srv,):
        cold = generate_on(srv, p, dp_rank=0)
        assert storage(cold) == 0 and cold["meta_info"]["cached_tokens"] == 0
        assert srv.wait_metric(BACKED_UP, HIT, timeout_s=180) == HIT
        other = generate_on(srv, p, dp_rank=1)  # replica 1 never saw P
        text = read(log)
    assert details(other)["storage"] == HIT and details(other)["device"] == 0, details(other)
    assert other["output_ids"] == cold["output_ids"]
    shards = {m.group(1) for m in POOL_LINE.finditer(text)}
    assert len(shards) == 1, shards  # both replicas opened the same namespace
    assert tracebacks_through(text) == [] and not BOUNDARY_FAILURE.search(text)


def test_same_served_name_other_weights_share_nothing(tmp_path: Path) -> None:
    models = make_model(tmp_path / "m0", "tiny", seed=0), make_model(tmp_path / "m1", "tiny", seed=1)
    store = tmp_path / "flash"
    store.mkdir()
    p = make_prompt(PROMPT, seed=5, model_dir=models[0])
    assert make_prompt(PROMPT, seed=5, model_dir=models[1]) == p
    logs = tmp_path / "a.log", tmp_path / "c.log"
    named = args_for(store, "--served-model-name", "tiny-shared", throttle=False)
    with running(server(models[0], named, logs[0]), server(models[1], named, logs[1])) as (a, c):
        a_cold = a.generate(p)
        assert a.wait_metric(BACKED_UP, HIT, timeout_s=180) == HIT
        c_out = c.generate(p)
        assert storage(c_out) == 0 and c_out["meta_info"]["cached_tokens"] == 0, details(c_out)
        # C's own pages are a hit for C: the store works for it, it just never reads A's.
        assert c.wait_metric(BACKED_UP, HIT, timeout_s=180) == HIT
        c.flush_cache()
        c_warm = c.generate(p)
        assert storage(c_warm) == HIT and c_warm["output_ids"] == c_out["output_ids"]
        texts = read(logs[0]), read(logs[1])
    pools = [POOL_LINE.search(t) for t in texts]
    assert pools[0] is not None and pools[1] is not None
    (ns_a, label_a, weights_a), (ns_c, label_c, weights_c) = pools[0].groups(), pools[1].groups()
    assert label_a == label_c == "tiny-shared" and weights_a != weights_c and ns_a != ns_c
    assert c_out["output_ids"] != a_cold["output_ids"]  # other weights: other KV, other answer
    assert all(tracebacks_through(t) == [] for t in texts)
