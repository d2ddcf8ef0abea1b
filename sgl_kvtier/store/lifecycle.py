"""Releasing what a shard holds: every step attempted whatever the others raise, the first error kept.

An open shard holds, newest first: (writer) its lease and journal; its IO engine and bounce buffers; its
layout (segment files or device fds); (writer) its writer lock. ``open`` takes them in the opposite order
under an ``Acquired`` stack; ``close``, and an ``open`` that fails half-way, give them back through here.

Invariants:
  * Every release step runs, in order, even when an earlier one raised, and at most once: a resource is
    detached from its owner before it is released, so a failed release is reported, never retried (Linux's
    ``close(2)`` frees the descriptor even when it reports an error).
  * ``close_all`` (a shard's ``close``) raises, after every step ran, ``StoreCloseError`` from the first
    failure, every ``(step, error)`` in ``failures``; the shard is closed all the same. ``release_all``
    (the parts below a shard) re-raises the first failure itself, the later ones as its notes.
  * An interrupt (anything not an ``Exception``) raised by a step is never wrapped nor swallowed: the
    remaining steps still run, then it is re-raised as it is.
  * An open that fails re-raises its own error; a release failing too becomes a note on it, never masking it.
  * No reference cycles, so a closed owner and all it held go by reference counting alone: a part calls
    back into its owner only weakly (``weak_method``), and no failure is kept by a frame of its own
    traceback (the helpers hand failures on, ``handed_on``, and raise what a helper made of them).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import ParamSpec, Self, TypeVar

from sgl_kvtier.errors import KVTierError

log = logging.getLogger(__name__)

Step = tuple[str, Callable[[], object]]  # (what is released, the call releasing it)
Failure = tuple[str, BaseException]  # (step, what it raised)
P = ParamSpec("P")
R = TypeVar("R")


def weak_method(method: Callable[P, R], gone: R) -> Callable[P, R]:
    """The bound ``method`` as a callback that holds its object weakly (the module's no-cycles invariant):
    for a part that calls back into its owner. Once the object is gone, a call answers ``gone``."""
    ref = weakref.WeakMethod(method)  # a bound method, as the docstring says

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        bound = ref()
        return gone if bound is None else bound(*args, **kwargs)

    return call


class StoreCloseError(KVTierError):
    """Closing a shard failed in at least one step; every other step still ran, so all it held is released.

    ``__cause__`` is the first failure (an ``OSError`` with its errno, typically); ``failures`` lists every
    ``(step, error)`` in step order. A failed ``checkpoint`` step loses nothing acknowledged: the next open
    replays the journal instead.
    """

    def __init__(self, what: str, failures: Sequence[Failure]):
        self.failures: tuple[Failure, ...] = tuple(failures)
        step, first = self.failures[0]
        more = "".join(f"; {s} also failed: {e!r}" for s, e in self.failures[1:])
        super().__init__(f"closing {what}: {step} failed: {first!r}{more} (everything else was released)")


def run_steps(steps: Iterable[Step]) -> list[Failure]:
    """Run every step in order, whatever the others raise; the ``(step, error)`` of each one that failed."""
    failures: list[Failure] = []
    for step, release in steps:
        try:
            release()
        except BaseException as exc:  # noqa: BLE001 - kept, and raised once every step has run
            failures.append((step, exc))
    return handed_on(failures)


def handed_on(failures: list[Failure]) -> list[Failure]:
    """``failures`` moved out of the caller's list (emptied) into a new one. A frame that called ``run_steps``
    is in every failure's traceback (a traceback holds its frames' callers), so by the no-cycles invariant
    it keeps none: it hands them on through this, or raises what a helper made of them."""
    moved = list(failures)
    failures.clear()
    return moved


def _first_interrupt(failures: Sequence[Failure]) -> BaseException | None:
    return next((exc for _, exc in failures if not isinstance(exc, Exception)), None)


def close_all(what: str, steps: Iterable[Step]) -> None:
    """Run every step (``run_steps``), then raise ``StoreCloseError`` from the first failure, if any."""
    failures = run_steps(steps)
    if failures:
        raise _close_error(what, handed_on(failures))


def _close_error(what: str, failures: list[Failure]) -> BaseException:
    """``close_all``'s error for ``failures``: the first interrupt as it is, else ``StoreCloseError`` from the
    first failure (the later ones logged)."""
    for step, exc in failures[1:]:
        log.warning("closing %s: %s also failed: %s", what, step, repr(exc))  # (no error kept by the record)
    interrupt = _first_interrupt(failures)
    if interrupt is not None:
        return interrupt
    error = StoreCloseError(what, failures)
    error.__cause__ = failures[0][1]  # as ``raise ... from`` sets it
    return error


def release_all(steps: Iterable[Step]) -> None:
    """Run every step (``run_steps``), then re-raise the first failure as it is, the others as its notes."""
    failures = run_steps(steps)
    if failures:
        raise _with_notes(handed_on(failures))


def _with_notes(failures: list[Failure]) -> BaseException:
    first = _first_interrupt(failures) or failures[0][1]
    for step, exc in failures:
        if exc is not first:
            first.add_note(f"{step} also failed: {exc!r}")
    return first


def abandon(error: BaseException, what: str, steps: Iterable[Step]) -> None:
    """``error`` stopped an open of ``what`` half-way: run the ``steps`` releasing what it held; each one
    that fails too becomes a note on ``error`` (which the caller re-raises). An interrupt raised by a step
    is raised here, after the other steps."""
    interrupt = _noted(error, what, run_steps(steps))
    if interrupt is not None:
        raise interrupt


def _noted(error: BaseException, what: str, failures: list[Failure]) -> BaseException | None:
    """Each of ``failures`` as a note on ``error`` (and a log line); the first interrupt among them."""
    for step, exc in failures:
        error.add_note(f"releasing {what} after the failed open: {step} failed too: {exc!r}")
        log.warning("releasing %s after a failed open: %s failed too: %s", what, step, repr(exc))
    return _first_interrupt(failures)


class ClosedOnExit:
    """``close`` as a context manager: a clean exit closes; an exit by an error closes too and keeps that
    error, the close's own failure riding along as its note (and logged). ``CLOSING`` names the thing."""

    CLOSING = "the resource"

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_error:  # the block's own error is the one to see; this one rides along
            exc.add_note(f"closing {self.CLOSING} failed too: {close_error!r}")
            log.warning("closing %s after an error failed too: %r", self.CLOSING, close_error)


class Acquired:
    """What an ``open`` holds so far. If the ``with`` block raises, it is all released, newest first
    (``abandon``: the open's own error propagates); if it returns, the opened object owns it all."""

    def __init__(self, what: str):
        self.what = what
        self._steps: list[Step | None] = []  # oldest first; None: dropped

    def push(self, step: str, release: Callable[[], object]) -> int:
        """Hold one more resource; returns its place, for ``drop``."""
        self._steps.append((step, release))
        return len(self._steps) - 1

    def drop(self, place: int) -> None:
        """Stop releasing the resource at ``place``: something pushed later releases it now (a wrapper)."""
        self._steps[place] = None

    def hand_over(self, steps: Sequence[Step]) -> None:
        """From here on, ``steps`` (in their order: an opened object's own) release everything held."""
        self._steps = list(reversed(steps))

    def __enter__(self) -> Acquired:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        steps, self._steps = [s for s in reversed(self._steps) if s is not None], []
        if exc is not None:
            abandon(exc, self.what, steps)
