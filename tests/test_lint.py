"""Static checks run by the test command (so CI runs them): ruff over the tree, mypy over the package.

Their configuration is in pyproject.toml (``[tool.ruff]``, ``[tool.mypy]``: strict where the code is ours
alone: keys, config, io, store, policy). Both tools are dev dependencies pinned in scripts/constraints.txt.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_ruff_is_clean():
    proc = _run("ruff", "check", "--no-cache", "sgl_kvtier", "tests", "benchmarks")
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-2000:]


def test_mypy_is_clean():
    proc = _run("mypy", "--no-error-summary", "--cache-dir", str(ROOT / ".mypy_cache"))
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-2000:]
