"""The shared-filesystem lab as a pytest plugin of the suite: fixture ``fs_lab``, one lab per test module (two
hosts, three with ``@pytest.mark.fs_lab_hosts(3)`` on the module's ``pytestmark``; MooseFS with
``@pytest.mark.fs_lab_fs("moosefs")``, JuiceFS otherwise), skipped with the reason
where none can be built here. The lab itself (``Lab``, ``Host``, its faults) is ``benchmarks.cluster.lab``,
which ``bench_cluster`` builds too; its names are re-exported here for the tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.cluster.lab import Host, Lab, LabError, unavailable, wait_for

__all__ = ["Host", "Lab", "LabError", "fs_lab", "unavailable", "wait_for"]


@pytest.fixture(scope="module")
def fs_lab(request: pytest.FixtureRequest) -> Iterator[Lab]:
    """A lab for this test module (module docstring); skipped with the reason where none can be built."""
    fs_marker = request.node.get_closest_marker("fs_lab_fs")
    fs = fs_marker.args[0] if fs_marker else "juicefs"
    why = unavailable(fs)
    if why is not None:
        pytest.skip(why)
    marker = request.node.get_closest_marker("fs_lab_hosts")
    with Lab(marker.args[0] if marker else 2, fs=fs) as lab:
        yield lab


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fs_lab_hosts(n): the module's fs_lab has n hosts (default 2)")
    config.addinivalue_line("markers", 'fs_lab_fs(name): the module\'s fs_lab filesystem, "juicefs" (default) or "moosefs"')
