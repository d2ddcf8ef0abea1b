"""The supported range, proven: the package built as a wheel, installed into the oldest supported SGLang's
environment (``scripts/setup.sh`` makes it, ``.venv-sglang-<release>``: that SGLang over the pinned set,
without sgl-kvtier), and there the adapter's contract tests, the plugins' all-or-nothing rule and real CPU
servers: one that does not ask for sgl-kvtier (nothing of ours in its log) and one with it as L3 (a hit
after a flush, a warm restart, identical output), both importing the installed wheel.

The inner run works from a directory outside the checkout, so the servers import the wheel, not the
source; its tests import the checkout's copy for their own use (``pythonpath`` in pyproject.toml). Tests
that need a newer SGLang skip there with that reason (listed in this test's output).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANGE_TESTS = [
    "tests/sglang/test_release.py", "tests/sglang/test_plugins.py", "tests/sglang/test_storage_adapter.py",
    "tests/sglang/test_storage_boundary.py", "tests/sglang/test_pool_registration.py",
    "tests/sglang/test_settings.py", "tests/sglang/test_host_pages.py", "tests/sglang/test_cpu_shims.py",
    "tests/sglang/test_cpu_shims_transfer.py", "tests/sglang/test_plain_server.py",
    "tests/sglang/test_kvtier_server.py",
]
# Skipped on the oldest release, each for a feature it lacks (an unexpected skip fails this test).
EXPECTED_SKIPS = {"HiCacheStorageConfig.dcp_size is new in SGLang 0.5.23"}

pytestmark = [pytest.mark.server, pytest.mark.timeout(1500)]


def oldest_release() -> str:
    sys.path.insert(0, str(ROOT))
    try:
        from sgl_kvtier.sglang.release import SUPPORTED
    finally:
        sys.path.pop(0)
    return SUPPORTED[0]


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_on_the_oldest_supported_sglang(tmp_path: Path) -> None:
    oldest = oldest_release()
    env_dir = ROOT / f".venv-sglang-{oldest}"
    python = env_dir / "bin" / "python"
    assert python.exists(), f"{env_dir} is missing: run bash scripts/setup.sh"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "PYTEST_")) and k != "PYTHONPATH"}

    # The wheel, built from the checkout's files (a copy: the build leaves nothing in the checkout).
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    src = tmp_path / "src"
    for name in files:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                 str(tmp_path / "dist"), str(src)], tmp_path, env, 600)
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = (tmp_path / "dist").glob("sgl_kvtier-*.whl")

    # Installed as a user would into an environment that has SGLang (its dependencies are there already).
    installed = run([str(python), "-m", "pip", "install", "-q", "--no-index", "--force-reinstall", "--no-deps",
                     "--disable-pip-version-check", str(wheel)], tmp_path, env, 600)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    where = run([str(python), "-c", "import sgl_kvtier, sglang; print(sgl_kvtier.__path__[0]); "
                 "import importlib.metadata as m; print(m.version('sglang'))"], tmp_path, env, 120)
    package, sglang = where.stdout.split()
    purelib = sysconfig.get_paths(vars={"base": str(env_dir), "platbase": str(env_dir)})["purelib"]
    assert Path(package).parent == Path(purelib) and sglang == oldest, where.stdout + where.stderr

    inner = run([str(python), "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT),
                 "-p", "no:cacheprovider", "-n", "0", "-q", "-rs", *[str(ROOT / t) for t in RANGE_TESTS]],
                tmp_path, env, 1400)
    tail = (inner.stdout + inner.stderr)[-6000:]
    print(tail)
    assert inner.returncode == 0, tail
    summary = inner.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary and "error" not in summary, summary
    reasons = set(re.findall(r"^SKIPPED \[\d+\] \S+: (.+)$", inner.stdout, re.MULTILINE))
    assert {re.sub(r" \(this is .*\)$", "", r) for r in reasons} <= EXPECTED_SKIPS, reasons
