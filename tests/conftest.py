"""Suite-wide: the test files that start real SGLang servers run first, longest first; the filesystem and
other-host fixtures that the store, media and sharing tests share (``ramfs``, ``hostproc``).

The suite runs on two pytest-xdist workers, a file per worker (``addopts`` in pyproject.toml), handed out
in collection order. Started first, the long files spread over both workers and the short ones fill in
after them, so neither worker is left running a long file alone at the end. A file not named here keeps
its place (only the balance, never a result, depends on this list).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_sharing import ROOT, WORKER, Proc

# Fixtures for tests that run SGLang's classes in this process; the shared-filesystem lab (``fs_lab``).
pytest_plugins = ["sglang_fixtures", "fs_lab"]

# Seconds each file's tests took in a full run on 2 workers of a 2-vCPU VM, longest first.
SLOW_FIRST = (
    "tests/sglang/test_shared_servers.py",  # ~360 s (three tests, two servers each)
    "tests/test_sglang_range.py",  # ~320 s (the wheel, the range tests and two servers on the oldest SGLang)
    "tests/experiments/test_stream_server.py",  # ~250 s
    "tests/experiments/test_stream_retract.py",  # ~240 s
    "tests/sglang/test_server_reliability.py",  # ~200 s
    "tests/test_bench_streaming.py",  # ~170 s
    "tests/sglang/test_cpu_server.py",  # ~160 s
    "tests/verify/test_verify_cli.py",  # ~155 s (two servers)
    "tests/test_bench_peers.py",  # ~150 s (two servers)
    "tests/test_bench_policy.py",  # ~140 s
    "tests/test_bench_serving.py",  # ~130 s
    "tests/sglang/test_cluster_servers.py",  # ~105 s
    "tests/sharing/test_fs_lab_servers.py",  # ~100 s (two servers on a JuiceFS lab)
    "tests/sglang/test_kvtier_server.py",  # ~95 s
    "tests/sglang/test_prometheus.py",  # ~80 s
    "tests/experiments/test_layer_loader.py",  # ~75 s
    "tests/test_bench_kit_memory.py",  # ~70 s
    "tests/sglang/test_plain_server.py",  # ~65 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: in-file order kept


@pytest.fixture
def ramfs(tmp_path):
    """A filesystem that refuses O_DIRECT: ramfs, mounted here (root only)."""
    d = tmp_path / "ramfs"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "ramfs", "ramfs", str(d)], capture_output=True).returncode:
        pytest.skip("mounting ramfs needs root")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)


class HostProc(Proc):
    """A ``sharing_worker.py`` process standing for another machine (its own ``KVTIER_BOOT_ID``)."""

    def __init__(self, boot: str) -> None:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "KVTIER_BOOT_ID": boot}
        self.p = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env, cwd=ROOT)


@pytest.fixture
def hostproc():
    """Start writer processes that stand for other machines (their own ``KVTIER_BOOT_ID``); killed after."""
    made: list[HostProc] = []

    def start(boot: str) -> HostProc:
        made.append(HostProc(boot))
        return made[-1]

    yield start
    for proc in made:
        if proc.p.poll() is None:
            proc.kill()
