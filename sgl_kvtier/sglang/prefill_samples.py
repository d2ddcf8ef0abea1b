"""Prefill samples of SGLang's extend batches for our backend's prefill model (``backend.cost.prefill``), and
``backend_of``: our backend behind a SGLang cache. Shared by the opt-in plugins that need them, none of which
imports another.

``record(scheduler, batch)`` (from a plugin's AFTER hook on ``Scheduler.process_batch_result``) records one
sample per EXTEND or MIXED batch into the backend behind ``scheduler.tree_cache``: its extend and prefix
lengths and the seconds from its launch to now. Before that, each batch observer (``OBSERVERS``, added by a
plugin's ``load`` through ``observe``) sees the batch, whatever the backend, and may take it out: a batch any
observer declines is no prefill sample (the observer may record it as something else). A plugin whose hook
samples every extend batch says so (``sample_every_batch``), so that another one, which samples only some,
leaves those to it (``every_batch_sampled``): never two samples of one batch.

Invariants: ``record`` never raises into the scheduler (a failure is counted on the backend's
``ErrorBoundary``, or on this module's without a backend, and the sample skipped); nothing of SGLang is
imported before a call needs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sgl_kvtier.telemetry.counters import ErrorBoundary

if TYPE_CHECKING:
    from sgl_kvtier.sglang.storage import KVTierStorage

logger = logging.getLogger(__name__)

BATCH_RESULT_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
PREFILL_MODES = frozenset({"EXTEND", "MIXED"})

# (scheduler, batch, backend or None, now) -> whether the batch stays a prefill sample. Never raises.
BatchObserver = Callable[[Any, Any, "KVTierStorage | None", float], bool]
OBSERVERS: list[BatchObserver] = []  # filled by plugins' ``load``, in order; empty by default

_every_batch = False  # a loaded plugin's hook samples every extend batch
_clock = time.monotonic  # replaceable in tests
_orphans = ErrorBoundary(logger)  # failures with no backend of ours to count them


def backend_of(cache: Any) -> KVTierStorage | None:
    """Our backend behind a HiCache tree: the cache's ``cache_controller.storage_backend``, SGLang's failure
    injector unwrapped (None: no HiCache, no L3 attached, or another backend)."""
    from sglang.srt.mem_cache import hicache_storage

    from sgl_kvtier.sglang.storage import KVTierStorage

    controller = getattr(cache, "cache_controller", None)  # absent or None: not a HiCache tree
    backend = getattr(controller, "storage_backend", None)  # None: no L3 attached (or detached)
    injector = getattr(hicache_storage, "HiCacheStorageFailureInjector", None)  # absent from older SGLang releases
    if injector is not None and isinstance(backend, injector):  # SGLANG_TEST_HICACHE_BACKEND_RANDOM_*
        backend = backend._backend
    return backend if isinstance(backend, KVTierStorage) else None


def observe(observer: BatchObserver) -> None:
    """``observer`` sees every extend batch ``record`` is given from now on in this process (idempotent)."""
    if observer not in OBSERVERS:
        OBSERVERS.append(observer)


def sample_every_batch() -> None:
    """The caller's hook hands every extend batch to ``record`` (a plugin's ``load``, once its hooks registered)."""
    global _every_batch
    _every_batch = True


def every_batch_sampled() -> bool:
    """Whether a loaded plugin's hook already samples every extend batch (then a partial sampler stands aside)."""
    return _every_batch


def record(scheduler: Any, batch: Any) -> None:
    """One prefill sample of ``batch`` (a ``ScheduleBatch`` whose result was just handled), unless it is no
    extend batch, has no backend of ours behind ``scheduler.tree_cache``, or an observer declines it."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    if not isinstance(batch, ScheduleBatch) or batch.forward_mode is None or batch.launch_ts is None:
        return
    if batch.forward_mode.name not in PREFILL_MODES or not batch.extend_lens:
        return
    backend = backend_of(getattr(scheduler, "tree_cache", None))
    now = _clock()
    sample = True
    for observer in tuple(OBSERVERS):  # each sees the batch, whatever an earlier one answered
        try:
            sample = observer(scheduler, batch, backend, now) and sample
        except Exception as exc:  # a bug in an observer: never into the scheduler loop
            (_orphans if backend is None else backend.boundary).fail("prefill sample observer", exc,
                                                                      outcome="sample skipped")
            sample = False
    if backend is None or not sample:
        return
    try:
        backend.cost.prefill.record_batch(list(batch.extend_lens), list(batch.prefix_lens), now - batch.launch_ts)
    except Exception as exc:  # a timing sample must never break the scheduler loop
        backend.boundary.fail("prefill timing", exc, outcome="sample skipped")


__all__ = ["BATCH_RESULT_TARGET", "OBSERVERS", "PREFILL_MODES", "BatchObserver", "backend_of", "every_batch_sampled",
           "observe", "record", "sample_every_batch"]
