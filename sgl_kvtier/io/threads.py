"""sgl-kvtier's threads as the OS sees them: named, so ``top -H`` / ``ps -L`` tell our CPU from SGLang's,
with the GIL switch interval set where asked (``io.priority``).

``io_thread_started`` is the initializer of every thread pool of ours that moves or verifies pages: it
names the worker's OS thread after its Python name (``kvtier-io_3``) and applies ``KVTIER_GIL_SWITCH_US``.
``name_this_thread`` alone serves our other threads (the lease heartbeat, the layer loader).

Naming is Linux's ``prctl(PR_SET_NAME)`` on the calling thread (the kernel keeps 15 bytes). Elsewhere, or
if libc refuses, the thread keeps its inherited name: naming never raises and never stops a thread.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from functools import cache
from typing import Any

from sgl_kvtier.io.priority import apply_gil_switch

logger = logging.getLogger(__name__)

PR_SET_NAME = 15  # linux/prctl.h
OS_NAME_BYTES = 15  # TASK_COMM_LEN - 1


@cache
def _libc() -> Any:
    """libc's handle on Linux (the process's own symbols: no library search, which would spawn
    ``ldconfig`` inside the first thread that names itself), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "prctl") else None
    except (OSError, AttributeError):
        return None


def os_name(name: str) -> bytes:
    """What the kernel keeps of ``name``: its first 15 bytes (UTF-8)."""
    return name.encode("utf-8", "replace")[:OS_NAME_BYTES]


def name_this_thread(name: str | None = None) -> bool:
    """Give the calling OS thread ``name`` (default: its Python thread's name). True if the kernel took it."""
    libc = _libc()
    if libc is None:
        return False
    try:
        return bool(libc.prctl(PR_SET_NAME, ctypes.c_char_p(os_name(name or threading.current_thread().name)),
                               0, 0, 0) == 0)
    except Exception as exc:  # noqa: BLE001 - a name is never worth a thread
        logger.debug("thread %s keeps its OS name (%s)", name, exc)
        return False


def io_thread_started() -> None:
    """Thread-pool initializer of our IO pools: the worker named after itself, and the process's GIL switch
    interval set where asked (``io.priority``)."""
    name_this_thread()
    apply_gil_switch()


__all__ = ["io_thread_started", "name_this_thread", "os_name"]
