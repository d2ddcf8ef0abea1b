"""Threads in tests without sleeping: run a call in a thread, join it under a bound, know a waiter parked.

``BOUND_S`` bounds every join and wait: reaching it is a failure, never a synchronisation. ``Parked`` is an
``on_block`` hook (``LayerGate``'s, ``stream_copy.ON_BLOCK``): it records the layers waiters were about to
block on, so a test knows a waiter is parked without sleeping. ``HeldCopy`` is a per-layer copy that holds one
layer in flight until the test releases it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

BOUND_S = 60.0


def start(fn: Callable, *args) -> tuple[threading.Thread, list]:
    """Run ``fn(*args)`` in a daemon thread; its return value (or exception) lands in the list."""
    out: list = []

    def body() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:  # noqa: B036 - handed to the test
            out.append(exc)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def finished(t: threading.Thread) -> bool:
    """Whether ``t`` ended within ``BOUND_S``."""
    t.join(BOUND_S)
    return not t.is_alive()


class Parked:
    """``on_block`` hook: the layers waiters were about to block on, in order."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.layers: list[int] = []

    def __call__(self, layer: int) -> None:
        with self.cond:
            self.layers.append(layer)
            self.cond.notify_all()

    def wait_count(self, n: int) -> None:
        """Until ``n`` waiters have parked."""
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.layers) >= n, BOUND_S), self.layers

    def wait_layer(self, layer: int) -> None:
        """Until a waiter has parked on ``layer``."""
        with self.cond:
            assert self.cond.wait_for(lambda: layer in self.layers, BOUND_S), self.layers


class HeldCopy:
    """A copy that records the layers it copied and holds ``held`` in flight until ``release``."""

    def __init__(self, held: int, fail_at: int | None = None) -> None:
        self.held = held
        self.fail_at = fail_at
        self.entered = threading.Event()
        self.release = threading.Event()
        self.copied: list[int] = []

    def __call__(self, layer: int) -> None:
        if layer == self.held:
            self.entered.set()
            assert self.release.wait(BOUND_S)
        if layer == self.fail_at:
            self.fail_at = None  # fails once: the synchronous retry succeeds
            raise RuntimeError(f"injected copy failure at layer {layer}")
        self.copied.append(layer)
