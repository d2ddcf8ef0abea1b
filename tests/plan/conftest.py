"""A small multi-turn trace in the Mooncake format: conversations over one shared system block, each turn
resending the history plus a new block."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest


def multiturn_rows(conversations: int = 24, turns: int = 4, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    next_id = [1]

    def new() -> int:
        next_id[0] += 1
        return next_id[0]

    rows, history = [], {c: [0, new()] for c in range(conversations)}
    t = 0.0
    for turn in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for c in order:
            t += rng.uniform(0.2, 1.5)
            if turn:
                history[c].append(new())
            ids = history[c]
            rows.append({"timestamp": int(t * 1000), "input_length": 512 * len(ids) - rng.randrange(0, 200),
                         "output_length": 64, "hash_ids": list(ids)})
    return rows


@pytest.fixture
def mooncake_trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in multiturn_rows()))
    return path
