"""Releasing what a shard holds: every step attempted whatever the others raise, the first error kept.

An open shard holds, newest first: (writer) its lease (file and ``kvtier-lease`` thread) and journal file;
its IO engine (threads or io_uring rings) and bounce buffers; its layout (segment files or device fds);
(writer) its writer-directory lock fd. ``open`` takes them
in the opposite order under an ``Acquired`` stack; ``close``, and an ``open`` that fails half-way, give
them back through the helpers here.

Invariants:
  * Every release step runs, in order, even when an earlier one raised. Each runs at most once: a
    resource is detached from its owner before it is released, so a failed release is reported, never
    retried (on Linux ``close(2)`` frees the descriptor even when it reports an error, and closing the
    number again could close a file someone else opened since).
  * ``close_all`` (a shard's ``close``) raises, after every step ran, ``StoreCloseError`` chained
    (``__cause__``) to the first failure, with every ``(step, error)`` in ``failures``; the later ones are
    also logged. The shard is released and closed all the same: a second ``close`` does nothing, and a
    re-open in the same process works.
  * A ``KeyboardInterrupt``/``SystemExit`` (anything not an ``Exception``) raised by a step is never
    wrapped nor swallowed: the remaining steps still run, then the first such one is re-raised as it is.
  * ``release_all`` (the parts below a shard: a layout's arenas, an arena's fds, the IO engine and its
    buffers) re-raises the first failure itself, the later ones attached as its notes; only the shard's
    close wraps it, so a caller sees one typed error naming the step.
  * An open that fails re-raises its own error: what it held is released newest first (``Acquired``),
    and a release that fails too becomes a note on that error (and a log line), never masking it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Self

from sgl_kvtier.errors import KVTierError

log = logging.getLogger(__name__)

Step = tuple[str, Callable[[], object]]  # (what is released, the call releasing it)
Failure = tuple[str, BaseException]  # (step, what it raised)


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
    return failures


def _first_interrupt(failures: Sequence[Failure]) -> BaseException | None:
    return next((exc for _, exc in failures if not isinstance(exc, Exception)), None)


def close_all(what: str, steps: Iterable[Step]) -> None:
    """Run every step (``run_steps``), then raise ``StoreCloseError`` from the first failure, if any."""
    failures = run_steps(steps)
    if not failures:
        return
    for step, exc in failures[1:]:
        log.warning("closing %s: %s also failed: %r", what, step, exc)
    interrupt = _first_interrupt(failures)
    if interrupt is not None:
        raise interrupt
    raise StoreCloseError(what, failures) from failures[0][1]


def release_all(steps: Iterable[Step]) -> None:
    """Run every step (``run_steps``), then re-raise the first failure as it is, the others as its notes."""
    failures = run_steps(steps)
    if not failures:
        return
    first = _first_interrupt(failures) or failures[0][1]
    for step, exc in failures:
        if exc is not first:
            first.add_note(f"{step} also failed: {exc!r}")
    raise first


def abandon(error: BaseException, what: str, steps: Iterable[Step]) -> None:
    """``error`` stopped an open of ``what`` half-way: run the ``steps`` releasing what it held; each one
    that fails too becomes a note on ``error`` (which the caller re-raises). An interrupt raised by a step
    is raised here, after the other steps."""
    failures = run_steps(steps)
    for step, exc in failures:
        error.add_note(f"releasing {what} after the failed open: {step} failed too: {exc!r}")
        log.warning("releasing %s after a failed open: %s failed too: %r", what, step, exc)
    interrupt = _first_interrupt(failures)
    if interrupt is not None:
        raise interrupt


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
