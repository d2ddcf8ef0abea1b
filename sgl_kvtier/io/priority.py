"""CPU priority of sgl-kvtier's IO threads: opt-in ``KVTIER_IO_NICE=N`` (-20..19; unset or 0: unchanged),
and how soon they get Python's GIL: opt-in ``KVTIER_GIL_SWITCH_US=N`` (50..100000; unset: Python's 5 ms).

Every thread pool of ours that moves or verifies pages (the engine's ``kvtier-io``, the store's
``kvtier-parts``, read-ahead's ``kvtier-readahead``, streamed tails' ``kvtier-stream``) calls
``renice_this_thread`` from its initializer (``io.threads.io_thread_started``): each worker, as it starts,
adds N to its own niceness (Linux ``setpriority`` on the thread id: one thread, never the process). A
positive N (lower priority) needs no privilege; a negative one (the IO before other work) needs
``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows it, and where refused is logged once and left alone.

Why: on a CPU engine a streamed L3 tail lands while its forward computes on the same cores, and an
OpenMP team waits at each barrier for its slowest thread, so CPU the IO threads take can cost the forward
more than itself; niced, they yield to the forward's threads. Measured on a 2-vCPU VM
(benchmarks/RESULTS.md): two runs of session 16 read break-even paired on/off 0.79 and 0.77 with
``KVTIER_IO_NICE=10`` against 0.81-0.82 without, but side by side in one run (session 17: a niced ``on``
twin in the same turns) it made no difference, twin / on paired 1.01: the landing's CPU must be done
before the forward can end either way (niced, the forward waits on groups longer and stalls less). So it
stays opt-in, for hosts whose other work should come before sgl-kvtier's IO. Inert for IO that runs while
the CPU is otherwise idle (a hit loaded whole before its forward). A bad value is logged once and ignored:
an IO thread never fails to start over its priority.

``KVTIER_GIL_SWITCH_US``: a thread waiting for the GIL asks its holder to drop it after Python's switch
interval (``sys.setswitchinterval``, 5 ms by default). In SGLang's scheduler process the forward's Python
holds the GIL between its torch calls, and every IO op of a streamed tail needs the GIL for its Python
around the syscall, so a landing can queue behind it for milliseconds per hand-over. Set, the first of our
IO threads to start in a process sets the interval to N us (``apply_gil_switch``): process-wide, every
thread's hand-overs come sooner (more switching). Measured on a 2-vCPU VM (``benchmarks/RESULTS.md``,
session 18): a streamed 201 MB hit through a throttled device beside a pure-Python thread holding the GIL
landed its last group at 700 ms with 5 ms, 619 with 1 ms (594 alone); in a server at break-even
(session 19, a twin at 1000 in the same turns) twin / on read paired 0.97, at the edge of the noise floor,
so it stays opt-in. ``KVTIER_IO_NICE=-10`` (the IO ahead of the forward, session 18): paired 0.98 and 1.01.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping

logger = logging.getLogger(__name__)

ENV = "KVTIER_IO_NICE"
MIN_NICE, MAX_NICE = -20, 19
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


def io_nice(environ: Mapping[str, str] | None = None) -> int:
    """The niceness step ``KVTIER_IO_NICE`` asks for: -20..19 (0: leave threads as they are)."""
    return _setting(environ, ENV, MIN_NICE, MAX_NICE, "IO threads keep their priority") or 0


def renice_this_thread() -> None:
    """Thread-pool initializer: add ``io_nice()`` to the calling thread's niceness. Never raises."""
    step = io_nice()
    if not step or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        nice = os.getpriority(os.PRIO_PROCESS, tid) + step
        os.setpriority(os.PRIO_PROCESS, tid, max(MIN_NICE, min(MAX_NICE, nice)))
    except OSError as exc:  # no privilege to raise it, or a sandbox without setpriority: the thread runs as is
        _warn_once(ENV, "%s=%d: IO thread priority left as it is (%s)", ENV, step, exc.strerror or exc)


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


__all__ = ["ENV", "MAX_NICE", "MIN_NICE", "SWITCH_ENV", "apply_gil_switch", "gil_switch_s", "io_nice",
           "renice_this_thread"]
