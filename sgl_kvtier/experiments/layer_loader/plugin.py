"""SGLang general plugin: layer-pipelined host -> device load-backs on CPU engines.

Switched on by ``KVTIER_LAYER_LOADER=1`` through the ``kvtier`` entry point and inert with a CUDA GPU, where SGLang
pipelines load-backs on its H2D stream; off, ``load()`` returns before it imports anything from SGLang. On CPU,
SGLang's streams and events are no-ops, so the layer loop of ``HiCacheController.start_loading``
(``L2TransferEngine.submit_host_to_device``) copies synchronously before the forward. The hooks run that loop on a
loader thread (``layer_gate.LayerLoad``): the submission (``submit_host_to_device``), the forward's per-layer wait
(``wait_until``), a join at the end of each step and before the next producer (``join_after``, ``join_before``) and
``UnifiedRadixCache.is_load_back_event_done`` (``load_back_event_done``).

Failures: a loader-thread exception is logged with its traceback and the waiting forward (or the join) copies the
remaining layers itself, the same SGLang copy in the thread that would run it without this plugin; only if that copy
fails too does its exception reach SGLang. Our own code (eligibility, submission) never raises into SGLang: it
counts, logs and copies synchronously.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from sgl_kvtier.experiments.layer_loader.layer_gate import LayerLoad
from sgl_kvtier.sglang.plugins import BY_NAME, HookSpec, register_all
from sgl_kvtier.telemetry.counters import ErrorBoundary

logger = logging.getLogger(__name__)

PLUGIN = BY_NAME["layer_loader"]
ENV_FLAG = PLUGIN.env
SUBMIT_TARGET = "sglang.srt.mem_cache.l2_transfer.L2TransferEngine.submit_host_to_device"
WAIT_TARGET = "sglang.srt.managers.cache_controller.LayerDoneCounter.wait_until"
PRODUCER_TARGET = "sglang.srt.managers.cache_controller.LayerDoneCounter.update_producer"
RUN_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"
EVENT_DONE_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.is_load_back_event_done"
SUBMIT_KWARGS = frozenset({"transfer_layer_id_max", "start_event", "on_layer_done"})
LOG_EVERY = 100  # a summary line after the first load and then every this many

BOUNDARY = ErrorBoundary(logger)  # our own failures (bugs): counted, logged, the copy runs synchronously
_loaded = False


@dataclasses.dataclass
class LoaderStats:
    """What the loader did in this process."""

    loads: int = 0  # load-backs run on the loader thread (and joined)
    layers: int = 0
    tokens: int = 0
    synchronous: int = 0  # eligible loads that ran synchronously because our submission failed
    loader_failures: int = 0  # loads whose loader thread failed (the rest was copied synchronously)
    sync_layers: int = 0  # layers copied by a waiting thread after a loader failure
    blocked_waits: int = 0  # forward waits that found their layer still in flight
    blocked_s: float = 0.0


STATS = LoaderStats()
_stats_lock = threading.Lock()


class InFlight:
    """The loads in flight in this process, from submission until their join."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[LayerLoad] = []

    def __bool__(self) -> bool:
        return bool(self._jobs)  # the wait hook's fast path: no lock

    def add(self, job: LayerLoad) -> None:
        with self._lock:
            self._jobs.append(job)

    def remove(self, job: LayerLoad) -> None:
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)

    def jobs(self) -> tuple[LayerLoad, ...]:
        with self._lock:
            return tuple(self._jobs)


IN_FLIGHT = InFlight()


def loader_wanted() -> bool:
    """True when the user opted in and there is no CUDA GPU (SGLang pipelines load-backs there)."""
    if not PLUGIN.wanted():
        return False
    import torch  # deferred: SGLang has already imported it wherever this runs

    return not torch.cuda.is_available()


def load() -> None:
    """Register every hook (``KVTIER_LAYER_LOADER=1``, no CUDA); idempotent within a process; all hooks or none."""
    global _loaded
    if _loaded or not loader_wanted():
        return
    hooks: list[HookSpec] = [(SUBMIT_TARGET, submit_host_to_device, "AROUND"), (WAIT_TARGET, wait_until, "AROUND"),
                             (PRODUCER_TARGET, join_before, "BEFORE"), (RUN_BATCH_TARGET, join_after, "AFTER"),
                             (EVENT_DONE_TARGET, load_back_event_done, "AROUND")]
    if not register_all(PLUGIN.name, hooks):
        return
    _loaded = True
    logger.info("sgl_kvtier layer loader on in pid %d: host -> device load-backs run layer by layer on a "
                "loader thread (hooks on %s, %s, %s, %s, %s)", os.getpid(), SUBMIT_TARGET, WAIT_TARGET,
                PRODUCER_TARGET, RUN_BATCH_TARGET, EVENT_DONE_TARGET)


# ---------------------------------------------------------------------------------------------- submission
class LoadFinishedEvent:
    """The completion's finish event of a load on the loader thread (in place of a no-op ``torch.cpu.Event``)."""

    def __init__(self, job: LayerLoad) -> None:
        self.job = job

    def query(self) -> bool:
        return self.job.complete

    def synchronize(self) -> None:
        join(self.job)

    def wait(self, stream: Any = None) -> None:
        join(self.job)

    def record(self, stream: Any = None) -> None:
        pass


def submit_host_to_device(original: Callable[..., Any], engine: Any, transfers: Any, *args: Any,
                          **kwargs: Any) -> Any:
    """AROUND hook: for eligible calls (``start_loading``'s), SGLang's submission here and its layer loop on the
    loader thread; the completion's ``finish_event`` is honest (``query()`` False until every layer landed,
    ``synchronize()`` joins). Every other call runs SGLang's original, e.g. ``UnifiedRadixCache.restore_kv_cache``,
    which relies on ``finish_event.synchronize()`` right after."""
    if args or not eligible(engine, transfers, kwargs):
        return original(engine, transfers, *args, **kwargs)
    join_all()  # normally nothing: the previous step joined its load (raises only what SGLang's copy raised)
    try:
        return submit_async(engine, transfers, **kwargs)
    except Exception as exc:
        STATS.synchronous += 1
        BOUNDARY.fail("layer loader submission", exc, outcome="copied synchronously")
        return original(engine, transfers, *args, **kwargs)


def eligible(engine: Any, transfers: Any, kwargs: dict[str, Any]) -> bool:
    """Whether this call may run on the loader thread: a CPU device module, ``on_layer_done`` a
    ``LayerLoadingEvent``'s (``start_loading``'s calls), MHA or MLA device pools, no shared (compacting) host
    layout. Any doubt, or an error deciding: no."""
    try:
        import torch
        from sglang.srt.environ import envs
        from sglang.srt.managers.cache_controller import LayerLoadingEvent
        from sglang.srt.mem_cache import l2_transfer
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.base import shared_host_layout_domains

        on_layer_done = kwargs.get("on_layer_done")
        layers = kwargs.get("transfer_layer_id_max")
        return bool(
            l2_transfer.device_module is torch.cpu
            and set(kwargs) <= SUBMIT_KWARGS
            and isinstance(getattr(on_layer_done, "__self__", None), LayerLoadingEvent)
            and isinstance(layers, int) and layers > 0
            and isinstance(transfers, list) and transfers
            and all(isinstance(t.device_pool, (MHATokenToKVPool, MLATokenToKVPool)) for t in transfers)
            and not shared_host_layout_domains(t.host_pool for t in transfers)
            and not envs.SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES.get()
        )
    except Exception as exc:
        BOUNDARY.fail("layer loader eligibility", exc, outcome="copied synchronously")
        return False


def submit_async(engine: Any, transfers: list[Any], *, transfer_layer_id_max: int, start_event: Any = None,
                 on_layer_done: Callable[[int], None] | None = None,
                 on_block: Callable[[int], None] | None = None) -> Any:
    """SGLang's ``_submission`` (start event, index preparation, ack events) with the loop on a thread.

    Returns SGLang's ``TransferCompletion`` with our ``LoadFinishedEvent`` as its finish event.
    ``on_block`` (tests) is passed to the load's gate.
    """
    stream = engine.host_to_device_stream
    with engine._submission(transfers, stream, "host_to_device", start_event) as (prepared, completion):
        tokens = len(prepared[0].device_indices)
        job = LayerLoad(transfer_layer_id_max, layer_copier(prepared, engine.io_backend), on_layer_done,
                        label=f"load-back of {tokens} tokens", tokens=tokens, on_block=on_block)
        IN_FLIGHT.add(job)
        try:
            job.start()
        except BaseException:
            IN_FLIGHT.remove(job)
            raise
    if STATS.loads == 0 and STATS.synchronous == 0:
        logger.info("kvtier layer loader: first load-back on the loader thread: %s, %d layers (pid %d)",
                    job.label, job.num_layers, os.getpid())
    return completion._replace(finish_event=LoadFinishedEvent(job), timing_enabled=False)


def layer_copier(transfers: Sequence[Any], io_backend: str) -> Callable[[int], None]:
    """One iteration of the layer loop of SGLang's ``L2TransferEngine.submit_host_to_device``, for prepared
    ``transfers``."""
    primary = transfers[0]

    def copy_layer(layer_id: int) -> None:
        for transfer in transfers:
            local = transfer.layer_mapper(layer_id) if transfer.layer_mapper is not None else layer_id
            if local is None or (transfer is not primary and transfer.layer_mapper is None
                                 and layer_id >= transfer.host_pool.layer_num):
                continue
            transfer.host_pool.load_to_device_per_layer_physical(
                transfer.device_pool, transfer.host_indices, transfer.device_indices, local, io_backend,
                is_draft=transfer.is_draft)

    return copy_layer


# ---------------------------------------------------------------------------------------------- gate and join
def wait_until(original: Callable[..., Any], counter: Any, threshold: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: layer ``threshold`` of every load in flight lands before SGLang's own wait. Keyed on the layer
    alone, not on the counter's consumer index: whatever batch reads the device pool, no layer is read before its
    copy completed."""
    if IN_FLIGHT:
        if isinstance(threshold, int) and not isinstance(threshold, bool):
            for job in IN_FLIGHT.jobs():
                job.wait(threshold)
        else:  # not a layer index we know: wait for everything
            join_all()
    return original(counter, threshold, *args, **kwargs)


def join_before(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook (``update_producer``): no new load while one is in flight (at most one load is, and a producer
    event is never reused while its loader runs)."""
    join_all()


def join_after(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook (``run_batch``): the step's loads end with its forward (no copy outlives its step; SGLang reaps
    their acks, ``ack_load_queue``, at the next step, after this join)."""
    join_all()


def load_back_event_done(original: Callable[..., Any], cache: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND hook: a load-back event is not done while a load is in flight."""
    done = bool(original(cache, *args, **kwargs))
    return done and not any(not job.complete for job in IN_FLIGHT.jobs())


def join_all() -> None:
    """Join every load in flight (in submission order)."""
    if IN_FLIGHT:
        for job in IN_FLIGHT.jobs():
            join(job)


def join(job: LayerLoad) -> None:
    """Join one load: complete after, or SGLang's copy raised (the load then stays in flight, still gating)."""
    job.join()
    with _stats_lock:
        if job not in IN_FLIGHT.jobs():
            return  # joined already (a second caller)
        IN_FLIGHT.remove(job)
        STATS.loads += 1
        STATS.layers += job.num_layers
        STATS.tokens += job.tokens
        STATS.loader_failures += job.loader_error is not None
        STATS.sync_layers += job.sync_layers
        STATS.blocked_waits += job.blocked_waits
        STATS.blocked_s += job.blocked_s
        due = STATS.loads == 1 or STATS.loads % LOG_EVERY == 0
    if due:
        logger.info("kvtier layer loader: %s", stats())


def stats() -> dict[str, Any]:
    """A copy of this process's loader counters."""
    return dataclasses.asdict(STATS)
