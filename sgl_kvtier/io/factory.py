"""The one place engines are built and stacked from a ``StoreConfig``.

Innermost first: the base engine (``make_engine``: ``threads``/``auto`` or ``uring``), then ``FaultyEngine``
when ``fault_injection`` is set (tests), then ``ThrottledEngine`` when ``throttle`` is set (benchmarks), so
real IO and injected faults both run inside the throttle's device time.

``uring`` is optional native code: before any of it runs in this process its probe must pass
(``probe.check("uring")``: a child process, cached per machine); otherwise opening the store fails with one
``ConfigError`` naming ``io_engine`` and the probe's reason. ``auto`` never probes.
"""

from __future__ import annotations

from sgl_kvtier.config import IOEngineName, StoreConfig
from sgl_kvtier.errors import ConfigError
from sgl_kvtier.io import probe as probes
from sgl_kvtier.io.engine import ThreadPoolEngine
from sgl_kvtier.io.faulty import FaultyEngine
from sgl_kvtier.io.ops import IOEngine
from sgl_kvtier.io.throttle import ThrottledEngine
from sgl_kvtier.io.uring import UringEngine


def make_engine(name: IOEngineName | str, depth: int) -> IOEngine:
    """The base engine called ``name`` (an ``IOEngineName`` or its value), ``depth`` ops in flight.

    ``auto`` is the thread pool: with large pages it moves as many bytes as io_uring and does not suffer when
    another Python thread holds the GIL (as SGLang's scheduler does); ``uring`` costs less CPU per op, so it
    stays selectable by name for small pages. Raises ``ConfigError("io_engine", ...)`` for an unknown name, a
    ``uring`` whose probe failed here, or one whose first ring cannot be set up.
    """
    try:
        engine = IOEngineName(name)
    except ValueError:
        raise ConfigError("io_engine", f"unknown engine {name!r}") from None
    if engine is not IOEngineName.URING:
        return ThreadPoolEngine(depth)
    verdict = probes.check("uring")
    if not verdict.available:
        raise ConfigError("io_engine", f'"uring" cannot run on this machine: {verdict.reason}; '
                                       f'use io_engine = "auto" (the thread pool)')
    try:
        return UringEngine(depth)  # liburing is imported only now, in UringEngine()
    except OSError as exc:  # the probe's small ring worked, this one does not (a larger depth, memlock)
        raise ConfigError("io_engine", f'"uring": cannot set up a ring of depth {depth}: {exc}') from exc


def open_engine(config: StoreConfig, base: IOEngine | None = None) -> IOEngine:
    """The engine stack for ``config``; ``base`` replaces the named base engine (tests inject one)."""
    engine = base or make_engine(config.io_engine, config.io_depth)
    faults, throttle = config.fault_spec(), config.throttle_spec()
    if faults is not None and config.fault_injection:  # an empty table injects nothing: no wrapper
        engine = FaultyEngine(engine, faults)
    if throttle is not None and config.throttle:
        engine = ThrottledEngine(engine, throttle)
    return engine
