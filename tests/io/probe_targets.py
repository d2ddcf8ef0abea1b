"""Fake engine probe targets for the probe tests: each runs only in a probe's child process.

Imported by ``sgl_kvtier.io.probe``'s child as ``probe_targets:<function>`` (the child inherits the test
process's ``sys.path``, which holds this folder). Never call these in the test process.
"""

from __future__ import annotations

import errno
import os
import signal
import threading


def ok() -> None:
    """A component that works."""


def die_sigill() -> None:
    """A wheel built for a newer CPU: the first call into it is an illegal instruction."""
    os.kill(os.getpid(), signal.SIGILL)


def die_sigsegv() -> None:
    """A native module that crashes."""
    os.kill(os.getpid(), signal.SIGSEGV)


def missing_package() -> None:
    """A binding whose package is not installed."""
    import sgl_kvtier_no_such_native_binding  # noqa: F401


def refused() -> None:
    """A syscall a seccomp filter answers with EPERM."""
    raise OSError(errno.EPERM, os.strerror(errno.EPERM))


def exits_without_verdict() -> None:
    """A native library that calls exit() itself."""
    os._exit(3)


def hangs() -> None:
    """A component that never answers."""
    threading.Event().wait()
