"""A per-layer gate and a layer-by-layer load on a loader thread: the machinery of layer-pipelined loads.

``LayerGate`` counts the complete layers of one load: ``advance(i)`` after layer ``i`` landed, ``wait_until(i)``
blocks until it has (True) or the load failed first (False), ``fail(exc)`` releases every waiter. Layers
complete in order, so "layer ``i`` done" means "layers ``0..i`` done".

``LayerLoad`` runs ``copy_layer(0) .. copy_layer(n - 1)`` on a thread of its own, advancing its gate after each
layer; ``wait(i)``, the consumer's side, returns once layer ``i`` is complete. If the loader failed, the waiting
thread copies the remaining layers itself (``finish``), so a waiter never returns before its layer is there;
``join()`` (the end of a step) waits for the loader and finishes a failed load the same way. A failure of that
synchronous copy is raised to the caller: the same copy, in the same thread, as without the loader.

Pure threading, no torch, no SGLang: the copy and the per-layer completion callback are injected (the layer
loader plugin and the streamed tail's loader both use it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sgl_kvtier.io.threads import name_this_thread

logger = logging.getLogger(__name__)

THREAD_NAME = "kvtier-layer-loader"
SLOW_WAIT_S = 30.0  # a waiter still blocked after this long logs a warning (and keeps waiting)


class LayerGate:
    """Progress of one load of ``num_layers`` layers: layers ``[0, done)`` are complete.

    ``on_block(layer)`` (optional) is called, outside the lock, each time a waiter is about to block for
    ``layer``: a test hook to know a waiter is parked without sleeping.
    """

    def __init__(self, num_layers: int, on_block: Callable[[int], None] | None = None) -> None:
        if num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {num_layers}")
        self.num_layers = num_layers
        self._on_block = on_block
        self._cond = threading.Condition()
        self._done = 0
        self._error: BaseException | None = None

    @property
    def done(self) -> int:
        """How many leading layers are complete."""
        return self._done

    @property
    def error(self) -> BaseException | None:
        """The failure passed to ``fail``, if any (stays set after a later ``advance``)."""
        return self._error

    @property
    def complete(self) -> bool:
        """True once every layer is complete."""
        return self._done >= self.num_layers

    def is_done(self, layer: int) -> bool:
        """True if ``layer`` is complete (no lock: ``done`` only grows)."""
        return layer < self._done

    def advance(self, layer: int) -> None:
        """Mark layers ``0..layer`` complete and wake the waiters they release."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        with self._cond:
            if layer >= self._done:
                self._done = layer + 1
                self._cond.notify_all()

    def finish(self) -> None:
        """Mark every layer complete."""
        if self.num_layers:
            self.advance(self.num_layers - 1)

    def fail(self, exc: BaseException) -> None:
        """Record a failure and release every waiter of a layer not yet complete (they see False)."""
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def wait_until(self, layer: int, timeout: float | None = None) -> bool:
        """Block until ``layer`` is complete (True), the load failed first, or ``timeout`` passed (False)."""
        if layer < self._done:
            return True
        if self._on_block is not None and self._error is None:
            self._on_block(layer)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while layer >= self._done and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return layer < self._done


class LayerLoad:
    """One load of ``num_layers`` layers, copied in order on a loader thread, gated per layer.

    ``copy_layer(i)`` copies layer ``i``; ``on_layer_done(i)`` (optional) is called after it, before the
    gate releases the layer. Both run on the loader thread, or on a waiting thread that finishes a failed
    load. ``label`` names the load in logs, ``tokens`` is its size for reports; ``on_block`` is passed to
    the gate.
    """

    def __init__(self, num_layers: int, copy_layer: Callable[[int], None],
                 on_layer_done: Callable[[int], None] | None = None, *, label: str = "load", tokens: int = 0,
                 on_block: Callable[[int], None] | None = None) -> None:
        self.gate = LayerGate(num_layers, on_block=on_block)
        self.label = label
        self.tokens = tokens
        self._copy = copy_layer
        self._on_layer_done = on_layer_done
        self._lock = threading.Lock()  # held by whoever copies: the loader, or a thread finishing for it
        self._thread: threading.Thread | None = None
        self.loader_error: BaseException | None = None
        self.sync_layers = 0  # layers copied by a waiting thread after a loader failure
        self.blocked_waits = 0  # waits that found their layer not yet complete
        self.blocked_s = 0.0  # time those waits spent blocked

    @property
    def num_layers(self) -> int:
        return self.gate.num_layers

    @property
    def complete(self) -> bool:
        return self.gate.complete

    def start(self) -> None:
        """Start the loader thread (if no thread can be started, copy everything here and now)."""
        thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # can't start new thread
            logger.error("kvtier layer loader: no thread for %s (%s): copying synchronously", self.label, exc)
            self.finish()
            return
        self._thread = thread

    def _run(self) -> None:
        name_this_thread()
        failed: BaseException | None = None
        with self._lock:
            try:
                for layer in range(self.gate.done, self.num_layers):
                    self._copy_one(layer)
            except BaseException as exc:  # noqa: B036 - nothing may escape a thread; the waiter finishes
                failed = exc
        if failed is not None:
            self.loader_error = failed
            logger.error("kvtier layer loader: %s failed at layer %d of %d (%s: %s); the forward copies the "
                         "rest synchronously", self.label, self.gate.done, self.num_layers,
                         type(failed).__name__, failed, exc_info=failed)
            self.gate.fail(failed)

    def _copy_one(self, layer: int) -> None:
        self._copy(layer)
        if self._on_layer_done is not None:
            self._on_layer_done(layer)
        self.gate.advance(layer)

    def wait(self, layer: int) -> None:
        """Return once ``layer`` is complete: wait for the loader, or finish its work if it failed."""
        if layer >= self.num_layers or self.gate.is_done(layer):
            return
        t0 = time.monotonic()
        self.blocked_waits += 1
        warned = False
        while not self.gate.wait_until(layer, timeout=SLOW_WAIT_S):
            if self.gate.error is not None:
                self.finish()
                break
            if not warned:
                warned = True
                logger.warning("kvtier layer loader: the forward has waited %.0f s for layer %d of %s "
                               "(%d of %d layers landed)", SLOW_WAIT_S, layer, self.label, self.gate.done,
                               self.num_layers)
        self.blocked_s += time.monotonic() - t0

    def finish(self) -> None:
        """Copy every layer not yet complete in this thread (after a loader failure, or without a thread).

        Only call it once the loader has failed or never started: it takes the loader's lock, so it would
        otherwise wait for the loader to end. Raises what the copy raises.
        """
        with self._lock:
            for layer in range(self.gate.done, self.num_layers):
                self._copy_one(layer)
                self.sync_layers += 1

    def join(self) -> None:
        """Wait for the loader thread; finish its layers here if it failed. Every layer is complete after."""
        if self._thread is not None:
            self._thread.join()
        if not self.gate.complete:
            self.finish()
