"""Suite-wide: the test files that start real SGLang servers run first, longest first.

The suite runs on two pytest-xdist workers, a file per worker (``addopts`` in pyproject.toml), handed out
in collection order. Started first, the long files spread over both workers and the short ones fill in
after them, so neither worker is left running a long file alone at the end. A file not named here keeps
its place (only the balance, never a result, depends on this list).
"""

from __future__ import annotations

import pytest

# Seconds each took serially on a 2-core machine (session 8), longest first.
SLOW_FIRST = (
    "tests/sglang/test_shared_servers.py",  # ~200 s
    "tests/test_sglang_range.py",  # ~170 s (the wheel, the range tests and two servers on the oldest SGLang)
    "tests/sglang/test_stream_server.py",  # ~140 s
    "tests/sglang/test_stream_retract.py",  # ~130 s
    "tests/sglang/test_server_reliability.py",  # ~120 s
    "tests/test_bench_policy.py",  # ~100 s
    "tests/test_bench_streaming.py",  # ~95 s
    "tests/sglang/test_kvtier_server.py",  # ~90 s
    "tests/sglang/test_cpu_server.py",  # ~90 s
    "tests/test_bench_serving.py",  # ~80 s
    "tests/sglang/test_cluster_servers.py",  # ~65 s
    "tests/sglang/test_layer_loader.py",  # ~55 s
    "tests/sglang/test_prometheus.py",  # ~55 s
    "tests/sglang/test_plain_server.py",  # ~45 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: in-file order kept
