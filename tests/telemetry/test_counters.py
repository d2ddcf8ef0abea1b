"""The rate-limited error log and the error boundary: counted by kind, a bug always with its traceback."""

from __future__ import annotations

import logging

from sgl_kvtier.errors import KVTierError
from sgl_kvtier.telemetry.counters import BoundaryCounts, ErrorBoundary, ErrorKind, RateLimitedLog

LOGGER = "test.kvtier.counters"


def raised(exc: BaseException) -> BaseException:
    """``exc`` with a traceback, as an ``except`` clause sees it."""
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - the point is to catch it
        return caught


def test_the_log_holds_back_past_its_burst_and_keeps_tracebacks(caplog):
    log = RateLimitedLog(logging.getLogger(LOGGER), burst=2, window=3600.0)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        for i in range(5):
            log.error("failure %d", i, exc_info=raised(TypeError(f"bug {i}")))
    assert [r.getMessage() for r in caplog.records] == ["failure 0", "failure 1"]
    assert all(r.exc_info is not None and r.exc_info[0] is TypeError for r in caplog.records)


def test_the_boundary_classes_counts_and_logs(caplog):
    boundary = ErrorBoundary(logging.getLogger(LOGGER), (KVTierError, OSError))
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert boundary.fail("batch_get_v1", raised(OSError("EIO"))) is ErrorKind.EXPECTED
        assert boundary.fail("batch_exists", raised(IndexError("off by one")), outcome="hit kept") \
            is ErrorKind.UNEXPECTED
    assert boundary.counts() == BoundaryCounts(expected=1, unexpected=1) and boundary.counts().total == 2
    fault, bug = caplog.records
    assert "batch_get_v1 failed (served as a miss): OSError: EIO" in fault.getMessage() and fault.exc_info is None
    assert "batch_exists failed (hit kept), unexpected IndexError: off by one" in bug.getMessage()
    assert bug.exc_info is not None and bug.exc_info[0] is IndexError


def test_a_flood_of_faults_does_not_hide_a_bug(caplog):
    boundary = ErrorBoundary(logging.getLogger(LOGGER), (OSError,), burst=3, window=3600.0)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        for _ in range(50):
            boundary.fail("batch_get_v1", raised(OSError("EIO")))
        boundary.fail("batch_set_v1", raised(TypeError("bug")))
    assert boundary.counts() == BoundaryCounts(expected=50, unexpected=1)
    assert len(caplog.records) == 4 and caplog.records[-1].exc_info[0] is TypeError
