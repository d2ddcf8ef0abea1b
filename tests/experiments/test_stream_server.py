"""Streamed L3 tails on real CPU servers: one server per streaming host layout, every
scenario on it, faults switched live through the store's fault control file (``stream_server_kit``).

The server: the tiny model (2 layers: 2 layer groups per page), HiCache with our backend, ``streaming =
"on"``, a throttled read path (3 MiB/s: one layer group of a 20-page hit is ~55 ms in flight), a
fault-injecting engine driven by a control file; the circuit breaker never trips (``breaker_failures`` at
its maximum), so each scenario sees its own fault and not the previous one's open circuit; SGLang's strict
memory checks are on (a leaked device slot or request row raises in the scheduler).

Requests: a stored prefix of ``PREFIX`` tokens (20 pages) and a suffix of ``SUFFIX`` tokens to compute, as
in the design (``sgl_kvtier.experiments.streaming``): a tail hides under the suffix's compute, the T_hide gate
admitting the request once the rest of its read is predicted to fit under that compute. Here the read and the compute are of one size, so
that rule would decide by the machine's load: the server runs the gate's safe minimum instead (admitted once
group 0 landed, ``KVTIER_TEST_STREAM_GATE=group0``; the rule itself is ``test_stream_gate``'s and
``test_stream_admit``'s, and ``bench_streaming``'s on real servers). Each scenario
uses fresh ``cache_salt``\\ s: it stores the prefix under one first (the primer), so the hit is exactly the
prefix, and nothing it computes is ever hit again. The cold answers are computed first, each once, under a
salt of their own (a salt changes the keys, never the computation), and their writes are waited for.

How a fault is made to strike *after* admission: the hit is read group-major, one IO batch per read group,
group 1's sent beside group 0's (``store.part_reads``), each op naming its read group. The fault is set
before the request with ``from_group = 1`` (``io.faulty``): only reads of group 1 draw it, so group 0 lands,
the gate admits the request, and group 1 fails (or stalls) while the forward waits on it (the throttle
charges a failed read its time, so group 1 ends a group's read after group 0): the loader's warning names
group 1, the verdict line names the request ``retracted``. Should the scheduler reach the gate only after
group 1's failure was known (a loaded machine), the tail is given up before admission instead: the answer is
checked all the same, nothing may be retracted, and the scenario runs again under a new salt (at most
``ATTEMPTS`` times). Holding group 0 (scenario 3) arms a watch on the control file, rewrites it (a stall, a
new mtime), sends the request and clears the stall once an IO batch opened the file.

Scenarios (per layout):
1. streamed tails answer exactly as cold (one at a time, then two at once), landed through the tail loader
   (the verdict lines), the whole hit counted as SGLang's storage hit;
2. faults on streamed tails: EIO and a vanished device before admission (the tail is given up at the gate,
   nothing retracted) and after it (retracted once, counted by SGLang); a stall past the loader's
   deadline; a checksum flip of stored bytes of the last layer group; every answer equal to cold, 0
   errors (HTTP 200, normal finish), 0 tracebacks through our code;
3. a tail is never visible before it is verified: a request sharing the prefix, served while the tail's
   group 0 is held in flight, gets no cached token (and, having computed the shared tokens, makes the tail
   be given up: its request then counts the sharer's KV as device tokens); a poisoned tail (stalled past
   the deadline, zero-filled) never helps a request sent after; once a tail's forward was good, the same
   prompt and the sharer hit it on the device.
   On this CPU route SGLang's forward blocks the scheduler: another request is matched only before a tail
   is admitted or after its verdict, the two moments these checks cover.
MLA layouts are not run: no MLA model runs on SGLang's CPU route here (``torch_native`` attention reads K
and V buffers; the model factory makes Qwen2 models only).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

from stream_server_kit import (  # noqa: E402
    FaultControl,
    ServerLog,
    Slot,
    cpu_route_missing,
    flip_last_bytes,
    in_background,
    page_geometry,
    stored_slots,
    verdict_of,
    written_chain,
)

from sgl_kvtier.serving.launch import BACKEND  # noqa: E402
from sgl_kvtier.serving.model_factory import make_model, make_prompt  # noqa: E402
from sgl_kvtier.serving.server import SGLangServer, cached_tiers, tracebacks_through  # noqa: E402

pytestmark = pytest.mark.server  # starts real SGLang servers

PAGE = 16
NEW_TOKENS = 8
PREFIX = 320  # stored tokens: 20 pages, two layer groups of 160 KiB each (tiny model, bf16)
SUFFIX = 3700  # computed tokens (the tiny model's context is 4096): 0.12-0.25 s on 2 idle cores, seconds on busy
# ones, while the forward waits for group 1 (55 ms in flight)
SHARED = 160  # tokens a sharer has in common with a prefix (its prompt stays under prefetch_threshold)
STALL_S = 5.0  # past the loader's deadline here: max(slow_io_s = 2 s, 4 x the ~55 ms predicted read)
HOLD_S = 1.0  # a stall that keeps group 0 in flight while another request is served
ATTEMPTS = 3
RETRACTED = "sglang:num_retracted_requests_total"
LANDED_TAILS, RETRACTED_TAILS = "kvtier_stream_landed", "kvtier_stream_retracts"  # the plugin's counters
UNFULFILLED = "sglang:storage_prefetch_unfulfilled_tokens_total"  # SGLang's: hits found and not used
ENV = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
       "KVTIER_TEST_STREAM_GATE": "group0"}  # admitted once group 0 landed, whatever the machine's load
PREFIXES = {"p1": 61, "p2": 62, "fault": 63, "held": 64, "flip": 65}  # name -> seed
LAYOUTS = ("layer_first", "page_first_direct")
EIO, DOWN, STALL = {"read_error_rate": 1.0}, {"down": [0]}, {"stall_rate": 1.0, "stall_s": STALL_S}


@dataclass
class Streamed:
    """One running server and what the scenarios share on it."""

    layout: str
    srv: SGLangServer
    log: ServerLog
    control: FaultControl
    store: Path
    prompts: dict[str, tuple[str, int]]  # name -> (text, tokens)
    cold: dict[str, dict[str, Any]] = field(default_factory=dict)

    def ask(self, name: str, rid: str, salt: str) -> dict[str, Any]:
        """Greedy answer to prompt ``name`` under ``salt``: HTTP 200 and a normal finish (no error, no abort)."""
        body = {"text": self.prompts[name][0], "rid": rid, "cache_salt": salt,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}}
        status, raw = self.srv.request("POST", "/generate", body)
        assert status == 200, raw[:500]
        out: dict[str, Any] = json.loads(raw)
        assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
        return out

    def answer_as_cold(self, name: str, out: dict[str, Any]) -> None:
        assert out["output_ids"] == self.cold[name]["output_ids"], name
        assert out["text"] == self.cold[name]["text"], name

    def store_prefix(self, name: str, salt: str) -> list[Slot]:
        """Compute prefix ``name`` under ``salt`` and wait until its pages are written (their slots)."""
        page_bytes, parts = page_geometry(self.log.since())
        newest = max((s.seq for s in stored_slots(self.store, page_bytes, parts)), default=-1)
        self.ask(f"{name}-prefix", f"prime-{salt}", salt)
        return written_chain(self.store, page_bytes, parts, newest, PREFIX // PAGE)

    def prime(self, name: str, salt: str) -> list[Slot]:
        """Store prefix ``name`` under ``salt`` in L3; then no faults, L1 and L2 empty. Returns its slots."""
        self.control.set()
        slots = self.store_prefix(name, salt)
        self.srv.flush_cache()
        return slots

    def retracted(self) -> float:
        return self.srv.metric(RETRACTED)

    def counts(self) -> dict[str, float]:
        """SGLang's retracts and unfulfilled hit tokens, the plugin's landed and retracted tails, now (the
        plugin's lag <= 1 s)."""
        return {name: self.srv.metric(name) for name in (RETRACTED, UNFULFILLED, LANDED_TAILS, RETRACTED_TAILS)}


def make_prompts(model: Path) -> dict[str, tuple[str, int]]:
    prompts: dict[str, tuple[str, int]] = {}
    for name, seed in PREFIXES.items():
        prefix = make_prompt(PREFIX, seed=seed, model_dir=model)
        prompts[f"{name}-prefix"] = (prefix, PREFIX)
        prompts[name] = (f"{prefix} {make_prompt(SUFFIX, seed=seed + 100)}", PREFIX + SUFFIX)
        words = prefix.split(" ")[:SHARED] + make_prompt(64, seed=seed + 200).split(" ")
        prompts[f"{name}-sharer"] = (" ".join(words), len(words))
    return prompts


def stored_tokens(prompt_tokens: int, device_hit: int) -> int:
    """Tokens SGLang backs up for one computed request: its KV (prompt + new tokens - 1) in whole pages, less
    what it matched on the device (in the tree, backed up before)."""
    return (prompt_tokens + NEW_TOKENS - 1) // PAGE * PAGE - device_hit


# ---------------------------------------------------------------------------------------------- the servers
def server_args(store: Path, control: Path, layout: str) -> list[str]:
    extra = {**BACKEND, "devices": [str(store)], "capacity_bytes": 256 << 20, "streaming": "on",
             "throttle": {"read_bytes_per_s": 3 << 20, "latency_s": 0.002},
             "fault_injection": {"seed": 13, "control_file": str(control)},
             "breaker_failures": 10_000}  # never trips: every scenario sees its own fault
    return ["--max-total-tokens", "16384", "--hicache-ratio", "2", "--enable-hierarchical-cache",
            "--hicache-io-backend", "direct", "--hicache-mem-layout", layout, "--page-size", str(PAGE),
            "--enable-cache-report", "--enable-metrics", "--skip-server-warmup",
            "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra)]


@pytest.fixture(scope="module", params=LAYOUTS)
def streamed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Streamed]:
    layout: str = request.param
    missing = cpu_route_missing(layout)
    if missing:
        pytest.skip(missing)
    tmp = tmp_path_factory.mktemp(f"stream-{layout}")
    model = make_model(tmp / "model", "tiny")
    store = tmp / "flash"
    store.mkdir()
    control = FaultControl(tmp / "faults.json")
    log_path = tmp / "server.log"
    with SGLangServer(model, extra_args=server_args(store, control.path, layout), env=ENV,
                      log_path=log_path) as srv:
        env = Streamed(layout, srv, ServerLog(log_path), control, store, make_prompts(model))
        backed = 0
        for name in [n for n in env.prompts if not n.endswith("-prefix")]:  # each prompt before its sharer
            env.cold[name] = out = env.ask(name, f"cold-{name}-{layout}", salt="cold")
            backed += stored_tokens(env.prompts[name][1], cached_tiers(out)["device"])
        srv.wait_metric("sglang:backuped_tokens_total", backed, timeout_s=180)  # stored whole, under "cold"
        yield env
    log = log_path.read_text(errors="replace")
    assert tracebacks_through(log) == []
    assert "memory leak detected" not in log and "Mem Leak Detected" not in log


@pytest.fixture
def clean(streamed: Streamed) -> Iterator[Streamed]:
    """The server with no faults; afterwards no traceback through our code in what it logged meanwhile."""
    streamed.control.set()
    mark = streamed.log.mark()
    yield streamed
    streamed.control.set()
    assert tracebacks_through(streamed.log.since(mark)) == []


def send_held(env: Streamed, name: str, rid: str,
              first: dict[str, Any] | None = None) -> tuple[Future[dict[str, Any]], int]:
    """Send ``name`` (its prefix primed under the salt ``rid``) under the knobs ``first`` (none: no faults); once an
    IO batch started under them (group 0's, and group 1's beside it, see the module docstring), clear them.
    Returns the answer and the log mark taken before the request."""
    env.prime(name, rid)
    mark = env.log.mark()
    with env.control.watch() as opened:
        env.control.set(**(first or {}))  # a new mtime: the engine opens the file again at its next batch
        answer = in_background(lambda: env.ask(name, rid, rid))
        assert opened.wait(60), "the store's engine never read the control file: no IO for the request"
    env.control.set()
    return answer, mark


def fail_group1(env: Streamed, name: str, scenario: str, fault: dict[str, Any], failure: str,
                then: Callable[[str], None] | None = None) -> tuple[str, str, dict[str, float]]:
    """Run ``name`` with ``fault`` aimed at its read group 1 (``from_group``) until the loader reports group 1
    ``failure`` (retried under a new salt when the failure was known before admission, see the module
    docstring). ``then(rid)`` runs once the failure is reported, faults off. Returns the request's rid, the
    log of its run, the counts before it."""
    for attempt in range(ATTEMPTS):
        rid = f"{scenario}-{env.layout}-{attempt}"
        before = env.counts()
        env.prime(name, rid)
        mark = env.log.mark()
        env.control.set(**fault, from_group=1)  # group 0, sent beside group 1, lands
        answer = in_background(partial(env.ask, name, rid, rid))
        seen = env.log.wait_for(f"request {rid}: layer group 1 {failure}", mark, stop=answer)
        env.control.set()  # the retry (loaded whole, or computed), its backups, later requests: a healthy device
        if seen is not None and then is not None:
            then(rid)
        env.answer_as_cold(name, answer.result(600))
        log = env.log.since(mark)
        if seen is not None:
            return rid, log, before
        # Group 1's failure was known before the gate admitted the request (module docstring): the tail was
        # given up before admission, no verdict, nothing retracted; the answer was checked above.
        verdict = verdict_of(log, rid)
        assert verdict is None and env.retracted() == before[RETRACTED], verdict
    raise AssertionError(f"group 1 failed before admission in all {ATTEMPTS} attempts")


def check_retracted(env: Streamed, rid: str, log: str, before: dict[str, float], failure: str) -> None:
    assert f"request {rid}: layer group 1 {failure}" in log  # group 0 landed: the failure came after it
    assert verdict_of(log, rid) == "retracted", "the tail was not admitted with its failure to come"
    assert log.count(f"retracted request {rid} after its forward") == 1  # once: its retry never streams
    assert f"requeued retracted request {rid}" in log
    assert env.srv.metric(RETRACTED) == before[RETRACTED] + 1  # counted where SGLang counts retracts
    seen = env.srv.wait_metric(RETRACTED_TAILS, before[RETRACTED_TAILS] + 1, timeout_s=30)  # gauges lag <= 1 s
    assert seen == before[RETRACTED_TAILS] + 1


# ---------------------------------------------------------------------------------------------- 1. identical
@dataclass(frozen=True)
class Warm:
    answers: dict[str, dict[str, Any]]  # rid -> answer: p1, p2 one at a time, then both at once
    log: str  # the server's log meanwhile
    before: dict[str, float]  # the counts before them


@pytest.fixture(scope="module")
def warm(streamed: Streamed) -> Warm:
    env = streamed
    mark, before, out = env.log.mark(), env.counts(), {}
    for name in ("p1", "p2"):
        rid = f"one-{name}-{env.layout}"
        env.prime(name, rid)
        out[rid] = env.ask(name, rid, rid)
    rids = {name: f"two-{name}-{env.layout}" for name in ("p1", "p2")}
    for name, rid in rids.items():
        env.store_prefix(name, rid)
    env.srv.flush_cache()
    jobs = {rid: in_background(lambda n=n, r=rid: env.ask(n, r, r)) for n, rid in rids.items()}
    out.update({rid: job.result(600) for rid, job in jobs.items()})
    return Warm(out, env.log.since(mark), before)


def test_streamed_tails_answer_as_cold(streamed: Streamed, warm: Warm) -> None:
    for rid, out in warm.answers.items():
        streamed.answer_as_cold(rid.split("-")[1], out)
        assert out["meta_info"]["cached_tokens"] == PREFIX and cached_tiers(out)["device"] == 0, \
            (rid, cached_tiers(out))
    verdicts = {rid: verdict_of(warm.log, rid) for rid in warm.answers}
    alone = [f"one-{n}-{streamed.layout}" for n in ("p1", "p2")]
    assert all(verdicts[rid] == "landed" for rid in alone), verdicts  # streamed, through the tail loader, kept
    # Two at once overlap in L3: at most the first one streams (the alone rule), the other loads whole.
    assert all(verdicts[rid] in (None, "landed") for rid in verdicts), verdicts
    landed = sum(v == "landed" for v in verdicts.values())
    assert streamed.srv.wait_metric(LANDED_TAILS, warm.before[LANDED_TAILS] + landed, 30) == \
        warm.before[LANDED_TAILS] + landed  # the plugin's counter agrees with its log
    assert streamed.cold["p1"]["output_ids"] != streamed.cold["p2"]["output_ids"]  # the equalities are not vacuous
    assert streamed.retracted() == warm.before[RETRACTED]
    # every hit was served whole from L3, the landed tails too: none of it counts as unfulfilled in SGLang's
    # metrics (a tail is counted by its outcome, not at the prefetch result that left it streaming)
    assert streamed.srv.metric(UNFULFILLED) == warm.before[UNFULFILLED]
    assert tracebacks_through(warm.log) == []


def test_streamed_tail_is_reported_as_a_storage_hit(streamed: Streamed, warm: Warm) -> None:
    for rid, out in warm.answers.items():
        assert cached_tiers(out) == {"device": 0, "host": 0, "storage": PREFIX}, rid


# ---------------------------------------------------------------------------------------------- 2. faults
@pytest.mark.parametrize("fault", [EIO, DOWN], ids=["eio", "down"])
def test_fault_before_admission_drops_the_tail(clean: Streamed, fault: dict[str, Any]) -> None:
    """Every IO fails from the start: group 0 never lands, the gate gives the tail up, the request computes.
    Asked under the cold answer's salt, the whole prompt is stored already: its backups write nothing (a
    vanished device fails writes too)."""
    env, rid = clean, f"before-{next(iter(fault))}-{clean.layout}"
    env.srv.flush_cache()
    mark, before = env.log.mark(), env.retracted()
    env.control.set(**fault)
    out = env.ask("fault", rid, "cold")
    env.answer_as_cold("fault", out)
    assert verdict_of(env.log.since(mark), rid) is None  # never admitted with its tail
    assert out["meta_info"]["cached_tokens"] == 0, cached_tiers(out)
    assert env.retracted() == before


@pytest.mark.parametrize("fault", [EIO, DOWN], ids=["eio", "down"])
def test_fault_after_admission_retracts(clean: Streamed, fault: dict[str, Any]) -> None:
    rid, log, before = fail_group1(clean, "fault", f"after-{next(iter(fault))}", fault, "failed")
    check_retracted(clean, rid, log, before, "failed")


def test_stall_past_the_deadline_retracts_and_never_helps_others(clean: Streamed) -> None:
    """Group 1 stalls past the loader's deadline: zeros, retract. A request sharing the prefix, sent once the
    tail was zero-filled, gets nothing of it and the cold answer."""
    env, sharers = clean, {}

    def send_sharer(rid: str) -> None:
        sharers[rid] = env.ask("fault-sharer", f"sharer-{rid}", rid)

    rid, log, before = fail_group1(env, "fault", "stall", STALL, "timeout", then=send_sharer)
    env.answer_as_cold("fault-sharer", sharers[rid])
    assert cached_tiers(sharers[rid])["device"] + cached_tiers(sharers[rid])["host"] == 0, cached_tiers(sharers[rid])
    check_retracted(env, rid, log, before, "timeout")


# ---------------------------------------------------------------------------------------------- 3. visibility
def test_a_sharer_never_sees_a_streaming_tail(clean: Streamed) -> None:
    """The tail's group 0 is held in flight (``HOLD_S``) while a request sharing its first ``SHARED`` tokens is
    served: no cached token (nothing of the unverified tail is in the tree), the cold answer. Having computed
    the shared tokens itself, the sharer moves the tree's end past the tail's start: the tail is given up, and
    its request reuses the sharer's computed KV (never the other way round), counted as device tokens."""
    env = clean
    for attempt in range(ATTEMPTS):
        rid = f"held-{env.layout}-{attempt}"
        before = env.retracted()
        answer, mark = send_held(env, "held", rid, first={"stall_rate": 1.0, "stall_s": HOLD_S})
        sharer = env.ask("held-sharer", f"sharer-{rid}", rid)
        env.answer_as_cold("held-sharer", sharer)
        out = answer.result(600)
        env.answer_as_cold("held", out)
        if verdict_of(env.log.since(mark), rid) is None:  # given up before admission, as it should
            assert sharer["meta_info"]["cached_tokens"] == 0, cached_tiers(sharer)  # nothing of the unverified tail
            break
        # The hold missed group 0 (another batch opened the control file first, or the request came after the
        # hold): the tail landed, verified, and its KV may have served the sharer as the tree's.
        assert cached_tiers(out) == {"device": 0, "host": 0, "storage": PREFIX}, cached_tiers(out)
    else:
        raise AssertionError(f"group 0 was never held in {ATTEMPTS} attempts")
    assert env.retracted() == before
    assert out["meta_info"]["cached_tokens"] == SHARED, cached_tiers(out)
    # the sharer's KV, not L3's
    assert cached_tiers(out) == {"device": SHARED, "host": 0, "storage": 0}, cached_tiers(out)


def test_a_verified_tail_serves_later_requests(clean: Streamed) -> None:
    """Alone, the prompt streams and lands; then its tail is the tree's: the same prompt and a sharer of its
    prefix hit it on the device."""
    env, rid = clean, f"held-alone-{clean.layout}"
    answer, mark = send_held(env, "held", rid)
    env.answer_as_cold("held", answer.result(600))
    assert verdict_of(env.log.since(mark), rid) == "landed"  # its forward waited for group 1 and kept it
    again = env.ask("held", f"again-{rid}", rid)  # no flush
    env.answer_as_cold("held", again)
    assert cached_tiers(again)["device"] >= PREFIX + SUFFIX - PAGE, cached_tiers(again)
    sharer = env.ask("held-sharer", f"sharer-{rid}", rid)
    env.answer_as_cold("held-sharer", sharer)
    assert cached_tiers(sharer)["device"] == SHARED, cached_tiers(sharer)


# ---------------------------------------------------------------------------------------------- 2. checksums
def test_checksum_flip_in_the_last_group_retracts(clean: Streamed) -> None:
    """Stored bytes of the last layer group of every prefix page go bad on disk after they were written:
    group 0 verifies and lands, group 1 fails its checksum under the forward: zeros, retract, recompute.
    (Were group 1's failure known before the gate admitted the request, its tail would be given up before
    admission: the scenario runs again under a new salt, as ``fail_group1`` does.)"""
    env = clean
    for attempt in range(ATTEMPTS):
        rid = f"flip-{env.layout}-{attempt}"
        flip_last_bytes(env.prime("flip", rid), page_geometry(env.log.since())[0])
        before, mark = env.counts(), env.log.mark()
        env.answer_as_cold("flip", env.ask("flip", rid, rid))
        log = env.log.since(mark)
        if f"request {rid}: layer group 1 failed" in log:
            check_retracted(env, rid, log, before, "failed")
            return
        assert verdict_of(log, rid) is None and env.retracted() == before[RETRACTED]
    raise AssertionError(f"group 1 failed before admission in all {ATTEMPTS} attempts")
