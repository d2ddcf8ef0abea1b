"""CPU priority of sgl-kvtier's IO threads: opt-in ``KVTIER_IO_NICE=N`` (1..19; unset or 0: unchanged).

Every thread pool of ours that moves or verifies pages (the engine's ``kvtier-io``, the store's
``kvtier-parts``, read-ahead's ``kvtier-readahead``, streamed tails' ``kvtier-stream``) calls
``lower_this_thread`` from its initializer (``io.threads.io_thread_started``): each worker, as it starts,
raises its own niceness by N (Linux ``setpriority`` on the thread id: one thread, never the process;
raising it needs no privilege).

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
MAX_NICE = 19
_warned = False


def io_nice(environ: Mapping[str, str] | None = None) -> int:
    """The niceness increment ``KVTIER_IO_NICE`` asks for: 0..19 (0: leave threads as they are)."""
    global _warned
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_NICE:
        if not _warned:
            _warned = True
            logger.warning("%s=%r: expected an integer 0..%d; IO threads keep their priority", ENV, raw, MAX_NICE)
        return 0
    return value


def lower_this_thread() -> None:
    """Thread-pool initializer: raise the calling thread's niceness by ``io_nice()``. Never raises."""
    step = io_nice()
    if not step or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + step))
    except OSError as exc:  # a sandbox without setpriority: the thread runs as it would have
        logger.debug("%s: thread %d keeps its priority (%s)", ENV, tid, exc)


__all__ = ["ENV", "MAX_NICE", "io_nice", "lower_this_thread"]
