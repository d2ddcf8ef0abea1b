"""Fixtures shared by the store's tests."""

from __future__ import annotations

import os
import subprocess

import pytest


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
