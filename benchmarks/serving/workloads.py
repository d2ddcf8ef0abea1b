"""The harness's workloads, as token-id requests grouped in phases: the multi-turn chat (from
``sgl_kvtier.serving.workload``, which ``sgl-kvtier verify`` plays too), document Q&A and the Mooncake trace.

Every prompt is a list of token ids sent as `input_ids`, so each configuration receives byte-identical
prompts and the token counts are exact. Tokens come from a seeded generator keyed by a name
(`"sys"`, `("user", client, round)`, a trace hash id, ...) and a per-run `salt`, so the same key always
gives the same block. The harness uses a different salt per concurrency level: each level starts cold
in every tier, on the same server.

Phase 0 of every workload is a warm-up that populates the caches and is not measured; the phases after
it are measured. Between phases the harness waits for L3 write-back, drops the OS page cache and
(optionally) flushes L1+L2: see `benchmarks.bench_serving`.
"""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path
from typing import Any

from sgl_kvtier.serving.workload import Request, TokenSource, Workload, multiturn, token_range, warmup_split

__all__ = ["TRACE_BLOCK_TOKENS", "Request", "TokenSource", "Workload", "docqa", "load_trace", "multiturn",
           "token_range", "trace"]

TRACE_BLOCK_TOKENS = 512  # the Mooncake trace's hash ids name 512-token prefix blocks


def docqa(src: TokenSource, *, documents: int, doc_tokens: int, questions: int, question_tokens: int,
          max_new_tokens: int) -> Workload:
    """Q questions over each of D long documents: prompt = document + question.

    Warm-up: one question per document (the first read of each document). Measured: the other questions,
    interleaved round-robin over the documents (the access order that defeats a small LRU cache).
    """
    if questions < 2:
        raise ValueError("docqa needs at least 2 questions per document: the first is the warm-up")
    docs = [src.block(("doc", d), doc_tokens) for d in range(documents)]

    def ask(d: int, q: int) -> Request:
        return Request(f"d{d}-q{q}", docs[d] + src.block(("q", d, q), question_tokens), max_new_tokens,
                       group=f"d{d}")

    warm = [ask(d, 0) for d in range(documents)]
    measured = [ask(d, q) for q in range(1, questions) for d in range(documents)]
    params = {"documents": documents, "doc_tokens": doc_tokens, "questions": questions,
              "question_tokens": question_tokens, "max_new_tokens": max_new_tokens}
    return Workload("docqa", [warm, measured], params,
                    f"{documents} documents x {doc_tokens} tokens, {questions} questions of {question_tokens} "
                    "tokens each; 1 question per document = warm-up")


def load_trace(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def trace(src: TokenSource, rows: list[dict[str, Any]], *, requests: int, block_tokens: int, max_tokens: int,
          max_new_tokens: int, time_scale: float, warmup_fraction: float) -> Workload:
    """Replay of the Mooncake conversation trace, scaled for the machine, keeping its reuse structure.

    - Conversations: requests whose first two hash ids agree share at least two prefix blocks (block 0,
      the service's system prompt, is shared by every request). Conversations with at least 2 requests
      are taken in order of first appearance until `requests` requests are selected; unrelated
      single-request traffic is left out (in the whole trace the median reuse distance is ~420
      requests, so a short contiguous window would show almost no reuse).
    - Tokens: each hash id maps to a fixed block of `block_tokens` tokens (TokenSource keyed by the id),
      so equal ids give equal blocks and the prefix structure is kept. Lengths scale by
      `block_tokens / 512`; a prompt is cut at `max_tokens` (cutting a prefix keeps the reuse).
    - Time: requests keep the trace's order. `time_scale` > 0 replays the timestamps multiplied by it
      (seconds per trace second) within each phase; 0 sends each request as soon as a slot is free.
    - Phases: the first `warmup_fraction` of the selected requests warm up, the rest are measured.
    """
    groups: dict[Any, list[int]] = collections.defaultdict(list)
    for i, row in enumerate(rows):
        if len(row["hash_ids"]) >= 2:
            groups[tuple(row["hash_ids"][:2])].append(i)
    chosen: list[int] = []
    for idx in sorted((g for g in groups.values() if len(g) >= 2), key=lambda g: g[0]):
        if len(chosen) >= requests:
            break
        chosen += idx
    chosen = sorted(chosen)  # whole conversations: may exceed `requests` by the last one's size
    scale = block_tokens / TRACE_BLOCK_TOKENS
    conv_of = {i: f"t{min(g)}" for g in groups.values() for i in g}
    built: list[Request] = []
    for i in chosen:
        row = rows[i]
        n = min(max(1, math.ceil(row["input_length"] * scale)), len(row["hash_ids"]) * block_tokens, max_tokens)
        tokens: list[int] = []
        for h in row["hash_ids"]:
            if len(tokens) >= n:
                break
            tokens += src.block(("blk", h), block_tokens)
        built.append(Request(f"req{i}", tokens[:n], max_new_tokens, arrival_s=row["timestamp"] / 1000.0,
                             group=conv_of[i]))
    phases, split = warmup_split(built, warmup_fraction, time_scale)
    params = {"requests": len(built), "block_tokens": block_tokens, "max_tokens": max_tokens,
              "max_new_tokens": max_new_tokens, "time_scale": time_scale, "warmup_fraction": warmup_fraction,
              "trace_rows": list(chosen)}
    return Workload("trace", phases, params,
                    f"Mooncake conversation trace: {len(built)} requests of multi-request conversations, "
                    f"512-token blocks -> {block_tokens} tokens, cut at {max_tokens}; "
                    f"first {split} = warm-up, " + (f"timestamps x{time_scale}" if time_scale > 0 else "closed loop"))
