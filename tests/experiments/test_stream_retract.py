"""Retracting a request after a forward whose KV must not count (``hooks.retract``), and requeuing it.

1. The bookkeeping, with SGLang's real ``Req``: which requests can be retracted, the last-resort abort, and
   the requeue order (filtered out of ``last_batch`` / ``running_batch`` at once, requeued with
   ``is_retracted=True`` only once no result still in the overlap loop's ``result_queue`` holds it).
2. Real CPU servers (tiny model, HiCache, chunked prefill), in SGLang's overlap loop and its normal loop:
   the testing knob ``KVTIER_TEST_RETRACT`` retracts chosen requests (one chunked, one not) right after
   their first prefill forward, with no streaming at all. Their greedy answers equal a cold run of the same
   prompts, nobody gets an error, no traceback goes through our code, and SGLang's own strict memory
   checks (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY`` / ``_IDLE``: device pool and request rows
   accounted at every step and at idle, raising on any leak) stay silent.
3. A streamed server (``streaming = "on"``, a throttled L3 device so hits have tails): the testing knob
   ``KVTIER_STREAM_FAULT=1:0`` fails layer group 0 of the first streamed tail: that request is retracted
   once, recomputes (never streaming again) and answers exactly as cold; the next one streams, lands and
   keeps its forward, with the same answer as cold. Its ``/metrics`` show the same story in the
   ``kvtier_stream_*`` series (tails, streamed pages, the zero-filled group, the retract), and the prefill
   samples that streaming feeds the gate's model with the cost plugin off.
"""

from __future__ import annotations

import json
import threading
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from test_prometheus import only, scrape  # noqa: E402

from sgl_kvtier.experiments.streaming import plugin as stream  # noqa: E402
from sgl_kvtier.experiments.streaming.hooks import copy as stream_copy
from sgl_kvtier.experiments.streaming.hooks import retract as stream_retract

PAGE = 16
STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}


def new_req(rid: str) -> Req:
    return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", range(1, 40)),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=1))


class Batch:
    """The parts of a ``ScheduleBatch`` the retract path reads; ``filter_batch`` records what it kept."""

    def __init__(self, reqs, mode: str = "EXTEND", decoding=None) -> None:
        self.reqs = list(reqs)
        self.forward_mode = SimpleNamespace(name=mode)
        self.decoding_reqs = decoding
        self.batch_is_full = True
        self.kept: list[list[int]] = []

    def filter_batch(self, keep_indices) -> None:
        self.kept.append(list(keep_indices))
        self.reqs = [self.reqs[i] for i in keep_indices]


class Scheduler:
    """The parts of a ``Scheduler`` the requeue reads: its overlap results and its queue entry point."""

    def __init__(self, result_queue=None) -> None:
        if result_queue is not None:
            self.result_queue = result_queue
        self.chunked_req = None
        self.queued: list[tuple[str, bool]] = []

    def _add_request_to_queue(self, req, is_retracted: bool = False) -> None:
        self.queued.append((req.rid, is_retracted))


# ---------------------------------------------------------------------------------------------- bookkeeping
def test_what_can_be_retracted() -> None:
    a, b, c = new_req("a"), new_req("b"), new_req("c")
    assert stream_retract.retractable(Batch([a], mode="DECODE"), a) == "forward mode DECODE"
    assert stream_retract.retractable(Batch([b]), a) == "not in the batch"
    assert stream_retract.retractable(Batch([a, b], mode="MIXED", decoding=[b]), b) == "a decode row of a mixed batch"
    assert stream_retract.retractable(Batch([a]), a) == "holds no KV"  # never allocated: nothing to release
    c.finished_reason = object()
    assert stream_retract.retractable(Batch([c]), c) == "already finished"


def test_an_unretractable_request_is_aborted_never_committed() -> None:
    req, sched = new_req("a"), Scheduler()
    sched.chunked_req = req
    before = stream_retract.stats()
    assert stream_retract.retract_or_abort(sched, Batch([req]), req, reason="test") is False
    assert req.skip_radix_cache_insert and req.discard_output_reason is not None  # dropped, KV never inserted
    assert sched._pending_chunked_abort_req is req  # released like a client abort: no next chunk
    after = stream_retract.stats()
    assert after["aborted"] == before["aborted"] + 1 and after["retracted"] == before["retracted"]


@pytest.mark.parametrize("overlap", [False, True])
def test_requeue_waits_for_the_last_in_flight_result(overlap: bool) -> None:
    a, b = new_req("a"), new_req("b")
    ran = Batch([b, a])  # the forward whose output of ``a`` must be dropped
    sched = Scheduler(result_queue=[(Batch([b, a]), object())] if overlap else None)
    stream_retract.pending(sched).append(a)  # what retract() leaves behind
    running = Batch([b])
    stream_retract.before_next_batch(sched, running_batch=running, last_batch=ran)
    assert ran.reqs == [b] and ran.kept == [[0]] and not ran.batch_is_full  # out of the merge into decode
    assert running.kept == []  # not there: untouched
    if overlap:  # its result is still queued: prepare_for_extend must not clear is_retracted before it
        assert sched.queued == [] and stream_retract.pending(sched) == [a]
        sched.result_queue.clear()  # the overlap loop processed that result
        stream_retract.before_next_batch(sched, running_batch=running, last_batch=Batch([]))
    assert sched.queued == [("a", True)] and stream_retract.pending(sched) == []


def test_the_knob_picks_by_rid_prefix_once() -> None:
    knob = stream_retract.RetractKnob("retract-")
    a, b, c = new_req("retract-1"), new_req("plain"), new_req("retract-2")
    c.retraction_count = 1  # retracted once already: never again (no retract loop)
    assert knob.pick(Batch([a, b, c])) == [a]
    assert knob.pick(Batch([a, b], mode="MIXED", decoding=[a])) == []
    with pytest.raises(ValueError):
        stream_retract.RetractKnob("")


def test_the_fault_knob() -> None:
    assert stream_copy.fault_group(3, "3:2") == 2 and stream_copy.fault_group(3, "4:2") is None
    assert stream_copy.fault_group(7, "all") == 0 and stream_copy.fault_group(1, "") is None
    assert stream_copy.fault_group(1, "x:y") is None  # a bad value is ignored (logged, counted)


# ---------------------------------------------------------------------------------------------- real servers
def generate(srv, text: str, rid: str, max_new_tokens: int = 8) -> dict:
    body = {"text": text, "rid": rid, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    status, raw = srv.request("POST", "/generate", body)
    assert status == 200, raw[:500]
    out: dict = json.loads(raw)
    return out


def concurrently(srv, jobs: list[tuple[str, str]]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    threads = [threading.Thread(target=lambda t=t, r=r: out.__setitem__(r, generate(srv, t, r))) for t, r in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return out


def check_log(log_path: Path) -> str:
    from sgl_kvtier.serving.server import tracebacks_through

    log = log_path.read_text(errors="replace")
    assert tracebacks_through(log) == []
    assert "memory leak detected" not in log and "Mem Leak Detected" not in log
    return log


@pytest.mark.server
@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_retracted_requests_answer_as_if_never_retracted(tmp_path: Path, loop: str) -> None:
    from sgl_kvtier.serving.model_factory import make_model, make_prompt
    from sgl_kvtier.serving.server import SGLangServer

    model = make_model(tmp_path / "model", "tiny")
    long_a, short_c, other_d = (make_prompt(n, seed=s, model_dir=model) for n, s in ((600, 31), (200, 32), (300, 33)))
    args = ["--max-total-tokens", "4096", "--enable-hierarchical-cache", "--hicache-ratio", "2",
            "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first", "--page-size", str(PAGE),
            "--chunked-prefill-size", "256", "--skip-server-warmup",
            *(["--disable-overlap-schedule"] if loop == "normal" else [])]
    env = {stream.ENV_FLAG: "1", stream_retract.ENV_TEST: "retract-", **STRICT}  # the knob is a stream hook
    log_path = tmp_path / "server.log"
    with SGLangServer(model, extra_args=args, env=env, log_path=log_path) as srv:
        a = generate(srv, long_a, "retract-a")  # 600 tokens: retracted after its first 256-token chunk
        both = concurrently(srv, [(short_c, "retract-c"), (other_d, "plain-d")])
        srv.flush_cache()  # the references: the same prompts computed cold, never retracted
        cold = {r: generate(srv, t, r) for t, r in ((long_a, "plain-a"), (short_c, "plain-c"), (other_d, "plain-d2"))}
    assert a["output_ids"] == cold["plain-a"]["output_ids"] and a["text"] == cold["plain-a"]["text"]
    assert both["retract-c"]["output_ids"] == cold["plain-c"]["output_ids"]
    assert both["plain-d"]["output_ids"] == cold["plain-d2"]["output_ids"]
    assert cold["plain-a"]["output_ids"] != cold["plain-c"]["output_ids"]  # the equalities are not vacuous
    assert a["meta_info"]["completion_tokens"] == 8  # no token of the dropped forward was committed
    log = check_log(log_path)
    for rid in ("retract-a", "retract-c"):
        assert log.count(f"kvtier stream: retracted request {rid} after its forward") == 1
        assert log.count(f"kvtier stream: requeued retracted request {rid}") == 1
    assert "retracted request plain" not in log  # only the chosen ones


@pytest.mark.server
def test_streamed_tails_that_fail_are_retracted_and_recomputed(tmp_path: Path) -> None:
    from sgl_kvtier.serving.launch import BACKEND
    from sgl_kvtier.serving.model_factory import make_model, make_prompt
    from sgl_kvtier.serving.server import SGLangServer

    model = make_model(tmp_path / "model", "tiny")
    store = tmp_path / "flash"
    store.mkdir()
    prompts = [make_prompt(900, seed=s, model_dir=model) for s in (41, 42)]
    extra = {**BACKEND, "devices": [str(store)], "capacity_bytes": 256 << 20, "streaming": "on",
             "throttle": {"read_bytes_per_s": 4 << 20, "latency_s": 0.002}}  # slow reads: hits have tails
    args = ["--max-total-tokens", "16384", "--hicache-ratio", "2", "--enable-hierarchical-cache",
            "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first", "--page-size", str(PAGE),
            "--enable-cache-report", "--enable-metrics", "--skip-server-warmup",
            "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra)]
    env = {stream_copy.ENV_FAULT: "1:0", "KVTIER_METRICS_INTERVAL_S": "0", **STRICT}  # group 0 of the first
    # streamed tail fails, later ones land; every scheduler step refreshes the kvtier_ gauges
    log_path = tmp_path / "server.log"
    with SGLangServer(model, extra_args=args, env=env, log_path=log_path) as srv:
        cold = [generate(srv, p, f"cold-{i}") for i, p in enumerate(prompts)]
        srv.wait_metric("sglang:backuped_tokens_total", 2 * (899 // PAGE * PAGE), timeout_s=180)
        srv.flush_cache()
        warm = [generate(srv, p, f"warm-{i}") for i, p in enumerate(prompts)]
        assert srv.metric("sglang:num_retracted_requests_total") == 1  # counted where SGLang counts retracts
        metrics = scrape(srv)  # refreshed by warm-1's decode steps, after its verdict
    ranks = {"tp_rank": "0"}
    assert only(metrics, "kvtier_streaming_enabled", **ranks) == 1
    assert only(metrics, "kvtier_stream_tails", **ranks) >= 2 and only(metrics, "kvtier_stream_loads", **ranks) >= 2
    assert only(metrics, "kvtier_stream_streamed_pages", **ranks) > 0
    assert only(metrics, "kvtier_stream_zero_filled_groups", **ranks) >= 1  # the injected one, and later ones not
    # landed by then (looked at without waiting once the tail failed)
    assert only(metrics, "kvtier_stream_poisoned", **ranks) == only(metrics, "kvtier_stream_retracts", **ranks) == 1
    assert only(metrics, "kvtier_stream_landed", **ranks) >= 1 and only(metrics, "kvtier_stream_aborted", **ranks) == 0
    assert only(metrics, "kvtier_stream_stall_seconds", **ranks) >= 0
    assert only(metrics, "kvtier_prefill_samples", **ranks) >= 1  # fed by streaming: the cost plugin is off
    assert [w["output_ids"] for w in warm] == [c["output_ids"] for c in cold]
    assert cold[0]["output_ids"] != cold[1]["output_ids"]
    log = check_log(log_path)
    assert "kvtier stream: first streamed load" in log, "no hit streamed: the path under test never ran"
    assert log.count("retracted request warm-0 after its forward") == 1  # blocked: its retry never streams
    assert "kvtier stream: requeued retracted request warm-0" in log and "warm-0=retracted" in log
    assert "warm-1=landed" in log and "retracted request warm-1" not in log  # streamed, verified, kept
