"""The rounds each bench_streaming server serves, and what the harness does before each.

L3 rounds (every server; bench_policy's ``prefix_rounds``): a write round puts D document prefixes in L3,
then ``prime`` rounds (unmeasured) and ``measured`` rounds per concurrency level each ask one new question
per document, after the L3 write-back drained, L1 + L2 were flushed and the page cache dropped: every
document prefix is in L3 only when its request arrives, and the question suffix is always computed.

Reference rounds (the reference server only, after its L3 rounds, never flushed before):
- ``device``: per concurrency level, each document asked two new questions back to back. Every document
  prefix is still in the device or host pool from the L3 round before, so these are L1 / L2 hits; at C = 1
  the second of each pair is a pure device (L1) hit, whose TTFT is the suffix's compute time.
- ``recompute``: per level, D documents never seen before: every prompt token is computed.

Request ids are unique within a server and identical across servers (same token source), so outputs can
be compared request by request between the ``off`` and ``on`` servers.
"""

from __future__ import annotations

from benchmarks.serving import workloads
from benchmarks.serving.policies import Round, prefix_rounds

DEVICE, RECOMPUTE, MEASURED = "device", "recompute", "measured"
SETTLED = ("prime", MEASURED)  # kinds preceded by write-back wait + flush + page-cache drop
# What each measured kind is called in the results' ``levels`` and the report.
LEVEL_OF = {MEASURED: "l3", DEVICE: "device", RECOMPUTE: "recompute"}


def streaming_rounds(src: workloads.TokenSource, *, documents: int, doc_tokens: int, question_tokens: int,
                     concurrency: list[int], rounds: int, prime_rounds: int, max_new_tokens: int,
                     reference_rounds: int, references: bool) -> list[Round]:
    """The L3 rounds, then (with ``references``) ``reference_rounds`` device rounds and as many recompute
    rounds per level (module docstring)."""
    out = prefix_rounds(src, documents=documents, doc_tokens=doc_tokens, question_tokens=question_tokens,
                        concurrency=concurrency, rounds=rounds, prime_rounds=prime_rounds,
                        max_new_tokens=max_new_tokens)
    if not references:
        return out
    docs = [src.block(("doc", d), doc_tokens) for d in range(documents)]  # docqa's documents, same keys

    def ask(d: int, c: int, r: int, k: int) -> workloads.Request:
        q = src.block(("qdev", d, c, r, k), question_tokens)
        return workloads.Request(f"d{d}-dev{c}.{r}.{k}", docs[d] + q, max_new_tokens, group=f"d{d}")

    for c in concurrency:
        for r in range(reference_rounds):
            out.append(Round(DEVICE, c, [ask(d, c, r, k) for d in range(documents) for k in (0, 1)]))
    for c in concurrency:
        for r in range(reference_rounds):
            fresh = [workloads.Request(f"n{c}.{r}.{d}", src.block(("fresh", c, r, d), doc_tokens)
                                       + src.block(("fq", c, r, d), question_tokens), max_new_tokens, group=f"n{d}")
                     for d in range(documents)]
            out.append(Round(RECOMPUTE, c, fresh))
    return out


def settles(kind: str) -> bool:
    """Whether a round of ``kind`` starts after write-back wait + flush + page-cache drop."""
    return kind in SETTLED
