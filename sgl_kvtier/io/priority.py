"""CPU priority of sgl-kvtier's IO threads: opt-in ``KVTIER_IO_NICE=N`` (-20..19; unset or 0: unchanged).

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
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

logger = logging.getLogger(__name__)

ENV = "KVTIER_IO_NICE"
MIN_NICE, MAX_NICE = -20, 19
_warned = False


def io_nice(environ: Mapping[str, str] | None = None) -> int:
    """The niceness step ``KVTIER_IO_NICE`` asks for: -20..19 (0: leave threads as they are)."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = MAX_NICE + 1
    if not MIN_NICE <= value <= MAX_NICE:
        _warn_once("%s=%r: expected an integer %d..%d; IO threads keep their priority", ENV, raw, MIN_NICE, MAX_NICE)
        return 0
    return value


def _warn_once(msg: str, *args: object) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(msg, *args)


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
        _warn_once("%s=%d: IO thread priority left as it is (%s)", ENV, step, exc.strerror or exc)


__all__ = ["ENV", "MAX_NICE", "MIN_NICE", "io_nice", "renice_this_thread"]
