"""The three workloads, as token-id requests grouped in phases.

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
import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

TRACE_BLOCK_TOKENS = 512  # the Mooncake trace's hash ids name 512-token prefix blocks


@dataclasses.dataclass
class Request:
    rid: str
    tokens: list[int]
    max_new_tokens: int
    arrival_s: float | None = None  # offset from the start of its phase; None: as soon as a slot is free
    group: str = ""  # client, conversation or document


@dataclasses.dataclass
class Workload:
    name: str
    phases: list[list[Request]]  # phases[0] is the warm-up
    params: dict[str, Any]
    description: str

    @property
    def requests(self) -> list[Request]:
        return [r for phase in self.phases for r in phase]

    def max_context(self) -> int:
        return max(len(r.tokens) + r.max_new_tokens for r in self.requests)

    def page_keys(self, phase: list[Request], page: int) -> set[bytes]:
        """Chained digests of every whole page of each prompt in `phase` (SGLang-style prefix keys)."""
        keys: set[bytes] = set()
        for r in phase:
            arr = np.asarray(r.tokens, dtype=np.int64)
            digest = b""
            for i in range(len(arr) // page):
                digest = hashlib.blake2b(digest + arr[i * page : (i + 1) * page].tobytes(), digest_size=16).digest()
                keys.add(digest)
        return keys

    def unique_tokens(self, page: int) -> list[int]:
        """Distinct prefix tokens (whole pages) seen after each phase, cumulative: the working set."""
        seen: set[bytes] = set()
        out = []
        for phase in self.phases:
            seen |= self.page_keys(phase, page)
            out.append(len(seen) * page)
        return out

    def summary(self, page: int) -> dict[str, Any]:
        return {
            "name": self.name, "description": self.description, "params": self.params,
            "requests_per_phase": [len(p) for p in self.phases],
            "prompt_tokens_per_phase": [sum(len(r.tokens) for r in p) for p in self.phases],
            "max_context_tokens": self.max_context(),
            "unique_prefix_tokens_cumulative": self.unique_tokens(page),
        }  # fmt: skip


class TokenSource:
    """Deterministic token blocks in [lo, hi): the same key and salt always give the same tokens."""

    def __init__(self, lo: int, hi: int, salt: int) -> None:
        if hi - lo < 16:
            raise ValueError(f"token range [{lo}, {hi}) is too small")
        self.lo, self.hi, self.salt = lo, hi, salt

    def block(self, key: Any, n: int) -> list[int]:
        seed = int.from_bytes(hashlib.sha256(repr((self.salt, key)).encode()).digest()[:8], "little")
        return np.random.default_rng(seed).integers(self.lo, self.hi, n).tolist()


def token_range(model_dir: Path) -> tuple[int, int]:
    """Ordinary token ids of a model: above the specials at the start of our factory's vocabulary,
    below the specials that real models put at the end."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))
    if vocab <= 4096:
        return 3, vocab  # sgl_kvtier's random models: ids 0-2 are the special tokens
    return 1000, min(vocab - 1000, 32000)


def multiturn(src: TokenSource, *, clients: int, rounds: int, system_tokens: int, user_tokens: int,
              answer_tokens: int, max_new_tokens: int) -> Workload:
    """N clients x R rounds over one shared system prompt; each round resends the whole history.

    Round r of client c is `system + (user_1 + answer_1) + ... + user_r`. The assistant answer that goes
    into the history is a fixed synthetic block of `answer_tokens` (the model's own output is discarded),
    so every configuration sees identical prompts. Round 1 is the warm-up; rounds 2..R are measured.
    """
    if rounds < 2:
        raise ValueError("multiturn needs at least 2 rounds: round 1 is the warm-up")
    system = src.block("sys", system_tokens)
    phases: list[list[Request]] = [[] for _ in range(rounds)]
    for c in range(clients):
        history = list(system)
        for r in range(rounds):
            history += src.block(("user", c, r), user_tokens)
            phases[r].append(Request(f"c{c}-r{r + 1}", list(history), max_new_tokens, group=f"c{c}"))
            history += src.block(("answer", c, r), answer_tokens)
    params = {"clients": clients, "rounds": rounds, "system_tokens": system_tokens, "user_tokens": user_tokens,
              "answer_tokens": answer_tokens, "max_new_tokens": max_new_tokens}
    return Workload("multiturn", phases, params,
                    f"{clients} clients x {rounds} rounds, {system_tokens}-token shared system prompt, "
                    f"+{user_tokens} user +{answer_tokens} answer tokens per round; round 1 = warm-up")


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
    split = max(1, min(len(built) - 1, round(len(built) * warmup_fraction)))
    phases = [built[:split], built[split:]]
    for phase in phases:
        t0 = phase[0].arrival_s or 0.0
        for r in phase:
            r.arrival_s = ((r.arrival_s or 0.0) - t0) * time_scale if time_scale > 0 else None
    params = {"requests": len(built), "block_tokens": block_tokens, "max_tokens": max_tokens,
              "max_new_tokens": max_new_tokens, "time_scale": time_scale, "warmup_fraction": warmup_fraction,
              "trace_rows": list(chosen)}
    return Workload("trace", phases, params,
                    f"Mooncake conversation trace: {len(built)} requests of multi-request conversations, "
                    f"512-token blocks -> {block_tokens} tokens, cut at {max_tokens}; "
                    f"first {split} = warm-up, " + (f"timestamps x{time_scale}" if time_scale > 0 else "closed loop"))
