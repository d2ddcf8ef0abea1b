"""plan.trace: the Mooncake format and SGLang's own request log (written by SGLang's RequestLogger), read into
chained block ids; bad records named by file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_kvtier.plan.trace import Trace, TraceError, TraceFormat, TraceRequest, load


def write_mooncake(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]},
    {"timestamp": 2500, "input_length": 1536, "output_length": 7, "hash_ids": [0, 1, 4]},
]


def test_mooncake_records_in_arrival_order_with_partial_last_blocks(tmp_path: Path) -> None:
    trace = load(write_mooncake(tmp_path / "t.jsonl", ROWS))
    assert trace.block_tokens == 512
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.0, 2.5]
    assert [r.blocks for r in trace.requests] == [(0, 3), (0, 1, 2), (0, 1, 4)]
    assert [trace.block_sizes(r) for r in trace.requests] == [[512, 88], [512, 512, 76], [512, 512, 512]]
    s = trace.summary()
    assert (s["requests"], s["block_refs"], s["unique_blocks"]) == (3, 8, 5)
    assert s["reusable_share"] == pytest.approx(3 / 8)


def test_head_and_repeat(tmp_path: Path) -> None:
    trace = load(write_mooncake(tmp_path / "t.jsonl", ROWS))
    assert len(trace.head(seconds=1.0).requests) == 2
    twice = trace.repeated(2)
    assert len(twice.requests) == 6 and twice.duration_s == pytest.approx(2.5 + 3.5)
    first, second = {b for r in twice.requests[:3] for b in r.blocks}, {b for r in twice.requests[3:] for b in r.blocks}
    assert not first & second  # each copy's blocks are its own


@pytest.mark.parametrize(("row", "field"), [
    ({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0]}, "hash_ids"),
    ({"timestamp": 0, "input_length": "600", "output_length": 5, "hash_ids": [0, 1]}, "input_length"),
    ({"timestamp": 0, "input_length": 600, "hash_ids": [0, 1]}, "output_length"),
    ({"input_length": 600, "output_length": 5, "hash_ids": [0, 1]}, "timestamp"),
    ({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, "x"]}, "hash_ids"),
])
def test_a_bad_mooncake_record_names_its_line_and_field(tmp_path: Path, row: dict, field: str) -> None:
    path = write_mooncake(tmp_path / "t.jsonl", [ROWS[0], row])
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: {field}"):
        load(path, TraceFormat.MOONCAKE)


def test_not_json_and_empty_and_missing(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0,\n')
    with pytest.raises(TraceError, match="bad.jsonl:1: not JSON"):
        load(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no records"):
        load(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match="no trace file"):
        load(tmp_path / "absent.jsonl")


def sglang_log(directory: Path, prompts: list[list[int]], latency_s: float = 0.25) -> None:
    """What a server started with --log-requests --log-requests-level 3 --log-requests-format json
    --log-requests-target DIR writes: SGLang's own RequestLogger, one finished request per prompt."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.utils.request_logger import RequestLogger

    logger = RequestLogger(True, 3, "json", [str(directory)])
    for i, ids in enumerate(prompts):
        obj = GenerateReqInput(input_ids=ids, rid=f"r{i}", sampling_params={"max_new_tokens": 3})
        logger.log_finished_request(obj, {"meta_info": {"prompt_tokens": len(ids), "completion_tokens": 3,
                                                        "e2e_latency": latency_s}, "output_ids": [1, 2, 3]})


def test_sglang_request_log_is_cut_into_chained_pages(tmp_path: Path) -> None:
    system = list(range(1000, 1064))
    prompts = [system + list(range(10)) * 4, system + list(range(10)) * 4 + [7] * 30, system + [5] * 64,
               [1] * 20]
    sglang_log(tmp_path / "logs", prompts)
    trace = load(tmp_path / "logs", block_tokens=32)
    assert trace.block_tokens == 32
    assert len(trace.requests) == 4 and trace.requests[0].arrival_s == 0.0
    assert all(r.output_tokens == 3 for r in trace.requests)
    a, b, c, d = trace.requests
    assert [r.input_tokens for r in trace.requests] == [104, 134, 128, 20]
    assert a.blocks[:3] == b.blocks[:3]  # the same first 96 tokens: the same chain
    assert a.blocks[3] != b.blocks[3]  # a's last 8 tokens are a partial page of their own
    assert c.blocks[:2] == a.blocks[:2] and c.blocks[2] != a.blocks[2]  # the system prompt, then other pages
    assert d.blocks[0] not in a.blocks  # equal ids only for equal prefixes


def test_sglang_log_without_token_ids_says_what_to_change(tmp_path: Path) -> None:
    line = {"timestamp": "2026-01-01T00:00:00", "event": "request.finished", "rid": "x",
            "obj": {"text": "hello", "input_ids": None}, "out": {"meta_info": {"e2e_latency": 0.1}}}
    (tmp_path / "h_0.log").write_text("[2026-01-01 00:00:00] " + json.dumps(line) + "\n")
    with pytest.raises(TraceError, match="input_ids: missing; log with --log-requests-level 3"):
        load(tmp_path / "h_0.log", TraceFormat.SGLANG)


def test_trace_block_sizes_never_exceed_the_prompt() -> None:
    trace = Trace((TraceRequest(0.0, 1024, 1, (1, 2)), TraceRequest(1.0, 1025, 1, (1, 2, 3))), 512, "x")
    assert [sum(trace.block_sizes(r)) for r in trace.requests] == [1024, 1025]
