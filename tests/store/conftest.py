"""Fixtures shared by the store's tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_sharing import ROOT, WORKER, Proc


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
