"""Prompts as token ids, grouped in phases: what the harness and ``sgl-kvtier verify`` send.

Every prompt is a list of token ids sent as ``input_ids``, so each configuration receives byte-identical
prompts and the token counts are exact. Tokens come from a seeded generator keyed by a name (``"sys"``,
``("user", client, round)``, a trace block id, ...) and a per-run ``salt``, so the same key always gives the
same block; a new salt gives prompts no cache has seen.

Phase 0 of every workload is a warm-up that populates the caches and is not measured; the phases after it
are measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from sgl_kvtier.plan.trace import Trace


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
        tokens: list[int] = np.random.default_rng(seed).integers(self.lo, self.hi, n).tolist()
        return tokens


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




def warmup_split(built: list[Request], warmup_fraction: float, time_scale: float) -> tuple[list[list[Request]], int]:
    """``built`` (in arrival order) as [warm-up, measured] with the first ``warmup_fraction`` warming up (at
    least one request in each), and the size of the warm-up. Each phase's arrivals restart at 0, times
    ``time_scale``; with ``time_scale`` 0 they are dropped (each request sent as soon as a slot frees)."""
    split = max(1, min(len(built) - 1, round(len(built) * warmup_fraction)))
    phases = [built[:split], built[split:]]
    for phase in phases:
        t0 = phase[0].arrival_s or 0.0
        for r in phase:
            r.arrival_s = ((r.arrival_s or 0.0) - t0) * time_scale if time_scale > 0 else None
    return phases, split


def from_trace(src: TokenSource, trace: Trace, *, block_tokens: int, max_tokens: int, max_new_tokens: int,
               time_scale: float, warmup_fraction: float) -> Workload:
    """A request trace (``sgl_kvtier.plan.trace``) as prompts: each block id becomes a fixed block of
    ``block_tokens`` tokens, so equal ids give equal prefixes and the trace's reuse is kept.

    Lengths scale by ``block_tokens / trace.block_tokens`` (at least one token), a prompt is cut at
    ``max_tokens`` (cutting keeps the reuse) and asks for its trace's output length, at most
    ``max_new_tokens``. ``time_scale`` > 0 replays arrivals times it (seconds per trace second) within each
    phase; 0 sends each as soon as a slot is free. The first ``warmup_fraction`` of the requests warm up.
    """
    if len(trace.requests) < 2:
        raise ValueError("a trace replay needs at least 2 requests: the first ones warm up")
    scale = block_tokens / trace.block_tokens
    built: list[Request] = []
    for i, req in enumerate(trace.requests):
        n = min(max(1, math.ceil(req.input_tokens * scale)), len(req.blocks) * block_tokens, max_tokens)
        tokens: list[int] = []
        for block in req.blocks:
            if len(tokens) >= n:
                break
            tokens += src.block(("blk", block), block_tokens)
        built.append(Request(f"t{i}", tokens[:n], max(1, min(req.output_tokens, max_new_tokens)),
                             arrival_s=req.arrival_s, group=f"b{req.blocks[0] if req.blocks else i}"))
    phases, split = warmup_split(built, warmup_fraction, time_scale)
    params = {"requests": len(built), "source": trace.source, "block_tokens": block_tokens,
              "max_tokens": max_tokens, "max_new_tokens": max_new_tokens, "time_scale": time_scale,
              "warmup_fraction": warmup_fraction}
    return Workload("trace", phases, params,
                    f"{trace.source}: {len(built)} requests, {trace.block_tokens}-token blocks -> {block_tokens} "
                    f"tokens, cut at {max_tokens}; first {split} = warm-up, "
                    + (f"arrivals x{time_scale}" if time_scale > 0 else "closed loop"))
