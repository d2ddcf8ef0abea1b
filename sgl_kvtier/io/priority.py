"""How soon sgl-kvtier's IO threads get Python's GIL: opt-in ``KVTIER_GIL_SWITCH_US=N`` (50..100000 us;
unset: Python's 5 ms).

A thread waiting for the GIL asks its holder to drop it after the switch interval
(``sys.setswitchinterval``). In SGLang's scheduler the forward's Python holds the GIL between torch calls,
and every IO op of a streamed tail needs the GIL around its syscall, so a landing can queue behind it for
milliseconds per hand-over. When set, the first of our IO threads to start in a process
(``io.threads.io_thread_started``) sets the interval to N us: process-wide, so every thread hands over
sooner (more switching); that is why it stays opt-in. A bad value is logged once and ignored: an IO thread
never fails to start over it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

logger = logging.getLogger(__name__)

SWITCH_ENV = "KVTIER_GIL_SWITCH_US"
MIN_SWITCH_US, MAX_SWITCH_US = 50, 100_000
_warned: set[str] = set()  # the settings whose trouble was logged (once each)
_switch_applied = False


def _setting(environ: Mapping[str, str] | None, name: str, low: int, high: int, kept: str) -> int | None:
    """The integer ``name`` asks for, in ``low..high``; None where unset, or not such an integer (logged once:
    ``kept`` says what stays as it was)."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = high + 1
    if not low <= value <= high:
        _warn_once(name, "%s=%r: expected an integer %d..%d; %s", name, raw, low, high, kept)
        return None
    return value


def _warn_once(name: str, msg: str, *args: object) -> None:
    if name not in _warned:
        _warned.add(name)
        logger.warning(msg, *args)


def gil_switch_s(environ: Mapping[str, str] | None = None) -> float | None:
    """The switch interval ``KVTIER_GIL_SWITCH_US`` asks for, in seconds (None: leave Python's)."""
    micros = _setting(environ, SWITCH_ENV, MIN_SWITCH_US, MAX_SWITCH_US,
                      "Python's switch interval kept (the value is in microseconds)")
    return None if micros is None else micros / 1e6


def apply_gil_switch() -> None:
    """Set the process's switch interval from ``KVTIER_GIL_SWITCH_US``, once per process. Never raises."""
    global _switch_applied
    if _switch_applied:
        return
    _switch_applied = True
    interval = gil_switch_s()
    if interval is not None:
        sys.setswitchinterval(interval)
        logger.info("%s: Python's thread switch interval set to %.0f us", SWITCH_ENV, interval * 1e6)


__all__ = ["MAX_SWITCH_US", "MIN_SWITCH_US", "SWITCH_ENV", "apply_gil_switch", "gil_switch_s"]
