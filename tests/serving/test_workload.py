"""serving.workload: prompts keyed by salt; a trace's block ids become shared prefixes; client routing."""

from __future__ import annotations

from sgl_kvtier.plan.trace import Trace, TraceRequest
from sgl_kvtier.serving.client import route
from sgl_kvtier.serving.workload import Request, TokenSource, from_trace, multiturn


def test_multiturn_prompts_depend_on_the_salt_only():
    def make(salt):
        return multiturn(TokenSource(3, 500, salt=salt), clients=2, rounds=3, system_tokens=32, user_tokens=8,
                         answer_tokens=4, max_new_tokens=2)

    a, b, c = make(1), make(1), make(2)
    assert [r.tokens for r in a.requests] == [r.tokens for r in b.requests]
    assert all(x.tokens != y.tokens for x, y in zip(a.requests, c.requests))
    r1, r2 = a.phases[0][0], a.phases[1][0]
    assert r2.tokens[:len(r1.tokens)] == r1.tokens and len(r2.tokens) == len(r1.tokens) + 4 + 8


def trace(*reqs: tuple[float, int, int, tuple[int, ...]]) -> Trace:
    return Trace(tuple(TraceRequest(*r) for r in reqs), 512, "t.jsonl")


def test_a_trace_becomes_prompts_sharing_prefixes_where_its_blocks_agree():
    t = trace((0.0, 1024, 10, (1, 2)), (1.0, 1500, 200, (1, 2, 3)), (3.0, 700, 5, (1, 4)), (5.0, 512, 1, (9,)))
    wl = from_trace(TokenSource(3, 500, salt=0), t, block_tokens=16, max_tokens=40, max_new_tokens=8,
                    time_scale=0.5, warmup_fraction=0.5)
    warm, measured = wl.phases
    a, b = warm
    c, d = measured
    assert (len(a.tokens), len(b.tokens), len(c.tokens), len(d.tokens)) == (32, 40, 22, 16)
    assert b.tokens[:32] == a.tokens and c.tokens[:16] == a.tokens[:16] and c.tokens[16:] != a.tokens[16:22]
    assert d.tokens != a.tokens[:16]
    assert (a.max_new_tokens, b.max_new_tokens, d.max_new_tokens) == (8, 8, 1)
    assert [r.arrival_s for r in warm] == [0.0, 0.5] and [r.arrival_s for r in measured] == [0.0, 1.0]
    assert a.group == b.group == c.group != d.group
    closed = from_trace(TokenSource(3, 500, salt=0), t, block_tokens=16, max_tokens=40, max_new_tokens=8,
                        time_scale=0, warmup_fraction=0.25)
    assert [len(p) for p in closed.phases] == [1, 3] and all(r.arrival_s is None for r in closed.requests)


def test_requests_of_one_group_go_to_one_endpoint():
    urls = ["http://a", "http://b", "http://c"]
    reqs = [Request(f"r{i}", [1], 1, group=f"c{i % 7}") for i in range(70)]
    seen: dict[str, set[str]] = {}
    for r in reqs:
        seen.setdefault(r.group, set()).add(route(urls, r))
    assert all(len(v) == 1 for v in seen.values()) and len(set().union(*seen.values())) > 1
    assert route(["http://only"], reqs[0]) == "http://only"
