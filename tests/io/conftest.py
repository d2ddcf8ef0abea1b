"""Every IO test gets its own probe cache file and a fresh in-process probe memo."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sgl_kvtier.io import probe as probes


@pytest.fixture
def probe_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point the probe cache at a fresh file (not created yet) and forget memoised verdicts."""
    path = tmp_path / "probe-cache" / "probe.json"
    monkeypatch.setenv(probes.CACHE_ENV, str(path))
    probes.clear_memo()
    yield path
    probes.clear_memo()


class CountingRunner:
    """A ``probe.Runner`` that really spawns the child (``run_child``) and counts the spawns."""

    def __init__(self) -> None:
        self.spawns = 0

    def __call__(self, p: probes.Probe) -> probes.ProbeVerdict:
        self.spawns += 1
        return probes.run_child(p)


@pytest.fixture
def runner() -> CountingRunner:
    """A fresh spawn-counting runner."""
    return CountingRunner()
