"""The client side of a serving measurement (the benchmarks and ``sgl-kvtier verify``): streamed /generate
(TTFT measured here, at the client), phases run with a bounded number of requests in flight (threads) over
one or more endpoints, and /metrics snapshots.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sgl_kvtier.serving.workload import Request

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

# Counters read before and after each phase (summed over TP ranks and other labels unless split).
COUNTERS = {
    "prompt_tokens": ("sglang:prompt_tokens_total", None),
    "cached_device": ("sglang:cached_tokens_total", {"cache_source": "device"}),
    "cached_host": ("sglang:cached_tokens_total", {"cache_source": "host"}),
    "cached_storage": ("sglang:cached_tokens_total", {"cache_source": "storage"}),
    "prefetched_tokens": ("sglang:prefetched_tokens_total", None),
    "backuped_tokens": ("sglang:backuped_tokens_total", None),
    "storage_prefetch_hit_tokens": ("sglang:storage_prefetch_hit_tokens_total", None),
}


def carries_tokens(chunk: dict[str, Any]) -> bool:
    """Whether a streamed /generate chunk holds generated output. SGLang streams an empty chunk (no output
    ids, ``completion_tokens`` 0) when it retracts a request, e.g. sgl-kvtier's retract of a request whose
    streamed L3 tail failed (measured: a chunk at the retract, 0.06 s in, before the first real token):
    the TTFT is the first chunk with a token, not the first chunk."""
    ids = chunk.get("output_ids")
    if ids is not None:
        return len(ids) > 0
    completion = chunk.get("meta_info", {}).get("completion_tokens")
    return bool(completion) if completion is not None else bool(chunk.get("text"))


# Where a TTFT went, from SGLang's own per-request time stats (the last chunk's meta_info, with
# --enable-metrics; realtime stamps, so comparable with the client's clock on the same host).
PHASES = ("received_s", "prefetch_wait_s", "queued_s", "forward_s", "returned_s")


def phases_of(meta: dict[str, Any], sent_at: float, ttft_s: float) -> dict[str, float] | None:
    """The TTFT of one request cut at SGLang's stamps, seconds, adding up to ``ttft_s``; None without them.

    - ``received_s``: sent -> SGLang's scheduler put it in its waiting queue (HTTP, tokenizer, IPC);
    - ``prefetch_wait_s``: of the time in the waiting queue, the polls that found its L3 prefetch not done
      (SGLang's ``storage_prefetch_wait``: first blocked poll to the ready one);
    - ``queued_s``: the rest of the waiting queue, up to the batch the request's prefill entered;
    - ``forward_s``: that batch formed -> its result processed (load-back of host pages, the forward, and
      with streamed tails their gate and verdict);
    - ``returned_s``: from there to the first token at the client (detokenizer, HTTP stream).

    SGLang keeps the first forward's stamps across a retract, so a retracted request's retry (its second
    wait and forward) falls in ``returned_s``.
    """
    need = ("queue_time", "forward_entry_time", "prefill_finished_time")
    if any(not isinstance(meta.get(k), (int, float)) for k in need):
        return None
    entered = float(meta["forward_entry_time"])
    queued = float(meta["queue_time"])
    wait = float(meta.get("storage_prefetch_wait") or 0.0)
    return {"received_s": entered - queued - sent_at, "prefetch_wait_s": wait, "queued_s": queued - wait,
            "forward_s": float(meta["prefill_finished_time"]) - entered,
            "returned_s": sent_at + ttft_s - float(meta["prefill_finished_time"])}


def stream_generate(url: str, req: Request, timeout_s: float = 1800.0, rid: str | None = None) -> dict[str, Any]:
    """One streamed /generate with `input_ids`; returns the per-request record (never raises).

    `rid` is sent as SGLang's request id (a router passes it on); the record's `meta_id` is the id the
    serving instance used (its request log names it)."""
    payload: dict[str, Any] = {
        "input_ids": req.tokens, "stream": True,
        "sampling_params": {"max_new_tokens": req.max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    }  # fmt: skip
    if rid is not None:
        payload["rid"] = rid
    body = json.dumps(payload).encode()
    http = urllib.request.Request(url + "/generate", data=body, method="POST",
                                  headers={"Content-Type": "application/json"})
    rec: dict[str, Any] = {"rid": req.rid, "group": req.group, "input_tokens": len(req.tokens)}
    t0 = time.perf_counter()
    rec["sent_at"] = time.time()
    first = last = None
    try:
        with urllib.request.urlopen(http, timeout=timeout_s) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                last = json.loads(line[5:])
                if first is None and carries_tokens(last):
                    first = time.perf_counter() - t0
    except (urllib.error.URLError, OSError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["latency_s"] = time.perf_counter() - t0
    if last is None or first is None:
        rec.setdefault("error", "no tokens streamed")
        return rec
    meta = last.get("meta_info", {})
    details = meta.get("cached_tokens_details") or {}
    rec.update(
        ttft_s=first, prompt_tokens=int(meta.get("prompt_tokens", len(req.tokens))),
        completion_tokens=int(meta.get("completion_tokens", 0)), cached_tokens=int(meta.get("cached_tokens", 0)),
        cached_device=int(details.get("device", 0)), cached_host=int(details.get("host", 0)),
        cached_storage=int(details.get("storage", 0)), storage_backend=details.get("storage_backend"),
        meta_id=meta.get("id"),
        # the whole output (SGLang's non-incremental stream: the last chunk holds it all), for comparisons
        text=last.get("text"), output_ids=last.get("output_ids"),
    )
    phases = phases_of(meta, rec["sent_at"], first)
    if phases is not None:
        rec["phases"] = phases
    return rec


def route(urls: Sequence[str], req: Request) -> str:
    """The endpoint of ``req`` among ``urls``: fixed by its group (client, conversation), so a conversation's
    prefixes stay on one instance, as behind a cache-aware router."""
    return urls[zlib.crc32(req.group.encode()) % len(urls)] if len(urls) > 1 else urls[0]


def run_phase(url: str | Sequence[str], requests: list[Request], concurrency: int,
              on_done: Callable[[dict[str, Any]], None] | None = None) -> tuple[list[dict[str, Any]], float]:
    """Send `requests` with at most `concurrency` in flight; (records in request order, wall seconds).

    `url` is one endpoint or several (each request goes to ``route``'s; its record names it as `url`).

    Requests without `arrival_s` go out in order as soon as a slot frees up (closed loop). With
    `arrival_s` (trace replay) each is released at that offset, then waits for a slot; `late_s` records
    how long after its arrival it was actually sent.
    """
    urls = [url] if isinstance(url, str) else list(url)
    slots = threading.Semaphore(concurrency)
    records: list[dict[str, Any] | None] = [None] * len(requests)

    def one(i: int, req: Request, due: float | None) -> None:
        try:
            where = route(urls, req)
            rec = stream_generate(where, req)
            if len(urls) > 1:
                rec["url"] = where
            if due is not None:
                rec["late_s"] = max(0.0, rec["sent_at"] - due)
            records[i] = rec
            if on_done is not None:
                on_done(rec)
        finally:
            slots.release()

    t0 = time.perf_counter()
    wall0 = time.time()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for i, req in enumerate(requests):
            due = None
            if req.arrival_s is not None:
                due = wall0 + req.arrival_s
                delay = due - time.time()
                if delay > 0:
                    time.sleep(delay)  # replay pacing (open loop), not synchronisation
            slots.acquire()
            pool.submit(one, i, req, due)
    wall = time.perf_counter() - t0
    return [r if r is not None else {"rid": requests[i].rid, "error": "lost"} for i, r in enumerate(records)], wall


def scrape(url: str, timeout_s: float = 30.0) -> list[tuple[str, dict[str, str], float]]:
    """All samples on /metrics as (name, labels, value); empty if the endpoint is unavailable."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return []
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            try:
                out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
            except ValueError:
                continue
    return out


# Why L3 hits were not used (or were postponed), split by SGLang's `reason` label.
BY_REASON = {"unfulfilled": "sglang:storage_prefetch_unfulfilled_tokens_total",
             "deferred": "sglang:storage_prefetch_deferred_tokens_total"}


def counters(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, (name, match) in COUNTERS.items():
        out[key] = sum(v for n, labels, v in samples
                       if n == name and all(labels.get(k) == want for k, want in (match or {}).items()))
    for prefix, name in BY_REASON.items():
        for n, labels, v in samples:
            if n == name and "reason" in labels:
                key = f"{prefix}_{labels['reason']}"
                out[key] = out.get(key, 0.0) + v
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after.keys() | before.keys()}


def wait_backups(url: str, at_least: float, timeout_s: float, stable_polls: int = 3,
                 poll_s: float = 0.5) -> dict[str, Any]:
    """Wait until `sglang:backuped_tokens_total` >= `at_least` and then unchanged over `stable_polls`
    polls (L3 write-back has drained), or `timeout_s`. Returns what was seen."""
    t0 = time.monotonic()
    history: list[float] = []
    while True:
        value = counters(scrape(url))["backuped_tokens"]
        history.append(value)
        settled = value >= at_least and len(history) > stable_polls and len(set(history[-stable_polls:])) == 1
        waited = time.monotonic() - t0
        if settled or waited > timeout_s:
            return {"backuped_tokens": value, "wanted_at_least": at_least, "waited_s": round(waited, 2),
                    "settled": settled}
        time.sleep(poll_s)
