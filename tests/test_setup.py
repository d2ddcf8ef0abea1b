"""The set-up is reproducible: every pip call in scripts/setup.sh installs under scripts/constraints.txt, and
the lock pins every package this environment holds at the version it holds (so the lock is what CI ran)."""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from sgl_kvtier.sglang.release import SUPPORTED

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"
LOCK = ROOT / "scripts" / "constraints.txt"


def _lock() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{line}: a lock pins one version"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def test_the_lock_pins_single_versions_of_distinct_packages():
    pins = _lock()
    assert len(pins) > 100 and {"sglang", "torch", "liburing", "numpy", "msgpack", "xxhash", "mypy", "ruff"} <= set(pins)
    assert pins["sglang"] == "0.5.23" and pins["torch"] == "2.14.1"


def test_every_pip_call_in_setup_uses_the_lock():
    """One pip command line, PIP, carries ``-c "$LOCK"``; every install goes through it, none around it."""
    lines = [ln.strip() for ln in SETUP.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert 'LOCK="$here/scripts/constraints.txt"' in lines
    assert 'PIP+=(-c "$LOCK")' in lines
    through_pip = [ln for ln in lines if ln.startswith('"${PIP[@]}"')]
    assert len(through_pip) >= 5  # pip itself, SGLang's set, SGLang, the package, its dev extras
    # The oldest supported SGLang's environment installs that SGLang alone, under the lock less its SGLang pin.
    assert f"OLDEST={SUPPORTED[0]}" in lines  # the release the range test runs on is the oldest supported one
    compat = [ln for ln in lines if ln.startswith('"$COMPAT/bin/python" -m pip install')]
    assert compat == ['"$COMPAT/bin/python" -m pip install -q --disable-pip-version-check -c "$COMPAT/constraints.txt" '
                      '--no-deps "sglang==$OLDEST"']
    assert """grep -v '^sglang==' "$LOCK" >"$COMPAT/constraints.txt"  # the lock, less its own SGLang pin""" in lines
    around = [ln for ln in lines if re.search(r"\bpip3?\b.*\binstall\b", ln) and not ln.startswith("PIP=(")
              and ln not in compat]
    assert not around, f"pip installs that bypass the lock: {around}"


@pytest.mark.skipif(not (Path(sys.prefix) / "pyvenv.cfg").exists() or Path(sys.prefix) != ROOT / ".venv",
                    reason="not the set-up's own .venv")
def test_this_environment_is_the_lock():
    """What setup.sh installed is exactly what the lock says (a package that moved, or came unpinned, fails)."""
    pins = _lock()
    ours = {"sgl-kvtier"}
    drift, unpinned = [], []
    site_dirs = [p for p in sysconfig.get_paths().values() if p.endswith("site-packages")]
    # the venv's own site-packages only: an imported setuptools puts its vendored copies on sys.path
    for dist in md.distributions(path=sorted(set(site_dirs))):
        name = canonicalize_name(dist.metadata["Name"])
        if name in ours:
            continue
        if name not in pins:
            unpinned.append(f"{name}=={dist.version}")
        elif pins[name] != dist.version:
            drift.append(f"{name}: installed {dist.version}, locked {pins[name]}")
    assert not drift and not unpinned, ("refresh with 'bash scripts/lock.sh'; " if unpinned else "") + \
        f"drift: {drift}; not in the lock: {unpinned}"
