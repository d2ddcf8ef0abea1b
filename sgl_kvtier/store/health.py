"""Per-device circuit breakers: stop sending IO to a sick device, probe it back later.

States: CLOSED (healthy) -> OPEN after ``failures`` consecutive failed or slow ops -> after ``cooldown_s``,
HALF_OPEN: IO is allowed again as a probe; a success closes the breaker, a failure reopens it with the
cool-down doubled (up to ``max_cooldown_s``). While OPEN, the store answers for that device's pages at
once without IO: reads and prefix lookups miss (SGLang recomputes), writes fail. A checksum mismatch is
bad data, not a sick device, and does not count.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class BreakerState(enum.Enum):
    """A device's circuit breaker state (see the module docstring)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class _Breaker:
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    cooldown: float = 0.0
    trips: int = 0
    events: list[tuple[float, str]] = field(default_factory=list)


class DeviceHealth:
    """The circuit breakers of one shard's devices, indexed like its arenas. Thread-safe."""

    def __init__(self, paths: list[str], failures: int = 3, cooldown_s: float = 5.0, slow_op_s: float = 2.0,
                 max_cooldown_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.paths = paths
        self.threshold = failures
        self.cooldown_s = cooldown_s
        self.slow_op_s = slow_op_s
        self.max_cooldown_s = max_cooldown_s
        self.clock = clock  # replaceable, for tests
        self._lock = threading.Lock()
        self._b = [_Breaker(cooldown=cooldown_s) for _ in paths]

    def state(self, device: int) -> BreakerState:
        """The device's breaker state now (an OPEN breaker past its cool-down reads HALF_OPEN)."""
        with self._lock:
            return self._advance(device)

    def usable(self, device: int) -> bool:
        """True unless the device's breaker is OPEN (HALF_OPEN lets IO through as a probe)."""
        with self._lock:
            return self._advance(device) is not BreakerState.OPEN

    def _advance(self, device: int) -> BreakerState:
        b = self._b[device]
        if b.state is BreakerState.OPEN and self.clock() - b.opened_at >= b.cooldown:
            b.state = BreakerState.HALF_OPEN
            self._note(device, b, "half_open: probing")
        return b.state

    def record(self, device: int, ok: bool, seconds: float = 0.0) -> None:
        slow = seconds > self.slow_op_s
        with self._lock:
            b = self._b[device]
            state = self._advance(device)
            if ok and not slow:
                b.failures = 0
                if state is BreakerState.HALF_OPEN:
                    b.state, b.cooldown = BreakerState.CLOSED, self.cooldown_s
                    self._note(device, b, "closed: device recovered")
                return
            b.failures += 1
            if state is BreakerState.HALF_OPEN or (state is BreakerState.CLOSED and b.failures >= self.threshold):
                if state is BreakerState.HALF_OPEN:
                    b.cooldown = min(b.cooldown * 2, self.max_cooldown_s)
                b.state, b.opened_at, b.failures = BreakerState.OPEN, self.clock(), 0
                b.trips += 1
                self._note(device, b, f"open: {'slow' if slow else 'failing'} IO; retry in {b.cooldown:.1f} s")

    def _note(self, device: int, b: _Breaker, what: str) -> None:
        b.events.append((self.clock(), what))
        del b.events[:-20]
        log.warning("device %s: circuit %s", self.paths[device], what)

    def summary(self) -> list[dict[str, Any]]:
        """Per device: its path, breaker state and trip count (JSON-ready)."""
        with self._lock:
            return [{"device": p, "state": self._advance(i).value, "trips": b.trips}
                    for i, (p, b) in enumerate(zip(self.paths, self._b))]
