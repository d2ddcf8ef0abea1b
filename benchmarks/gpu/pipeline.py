"""gpu_stream's timed paths: an L3 hit's prefix read from the store into host memory, copied to the device,
and the suffix's stand-in prefill that reads it, layer by layer.

- ``compute_only``: the prefix KV already on the device (a device hit): the layers alone.
- ``load_all`` (the hit loaded whole, (a)): ``SharedPool.get`` reads every page whole (every part verified), then
  the host -> device copies are queued on the load stream chunk by chunk (``HostKV.load_chunks``: per layer,
  or per layer group where a copy per layer would be per page too), each followed by an event, and layer
  l's compute waits on its chunk's event (the layer-pipelined load-back SGLang does on a GPU). TTFT-like =
  read + the pipelined tail.
- ``streamed`` ((b)): a reader thread runs ``SharedPool.get_parts`` group-major with the pool's layer
  groups; as each group lands verified on every page (``on_part``), its layers' copies are queued on the
  load stream and an event recorded; the compute thread runs layer l once l's group has landed (a CPU
  wait on a ``threading.Event``) and its copy event (a stream wait). So group g's compute overlaps the reads
  of groups > g. A group that fails on some page is not copied (its device bytes stay zero) and the run is
  marked not ``ok``.
- ``h2d_only``: the copies of every layer from a filled host buffer, alone.

Ordering: a group's copies are queued only after ``on_part`` says it is verified in host memory (never an
unverified byte on the device); a layer's compute is queued only after its group's copy event. Every timing
ends with a device synchronize. On a CPU the streams and events are no-ops (the copies run inline), the
code path is the same.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.gpu.kvstore import DeviceKV, HostKV
from benchmarks.gpu.prefill import StandIn
from sgl_kvtier.keys import PageKey
from sgl_kvtier.sglang.parts_plan import LayerPlan
from sgl_kvtier.sharing.pool import SharedPool

GROUP_TIMEOUT_S = 600.0  # bounds a failure (a reader thread that died without saying so), never a wait


@dataclass
class Timing:
    total_s: float
    read_s: float | None = None  # load_all: the whole read into host memory
    waited_s: float = 0.0  # streamed: time the compute thread spent waiting for groups to land
    group_landed_s: list[float] = field(default_factory=list)  # streamed: when each group had landed
    ok: bool = True  # every page read and verified


class Sync:
    """The load stream and its events on a GPU; no-ops on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.load = torch.cuda.Stream(device=device) if self.cuda else None

    @contextlib.contextmanager
    def on_load(self) -> Iterator[None]:
        if self.load is None:
            yield
            return
        with torch.cuda.stream(self.load):
            yield

    def record(self) -> Any:
        if self.load is None:
            return None
        event = torch.cuda.Event()
        event.record(self.load)
        return event

    def wait(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _layers(model: StandIn, kv: DeviceKV, sync: Sync, before: Callable[[int], None]) -> None:
    x = model.x0
    for layer in range(model.geom.layers):
        before(layer)
        x = model.forward_layer(layer, x, kv)
    sync.synchronize()


def compute_only(model: StandIn, kv: DeviceKV, sync: Sync) -> Timing:
    t0 = time.perf_counter()
    _layers(model, kv, sync, lambda _layer: None)
    return Timing(time.perf_counter() - t0)


def h2d_only(host: HostKV, kv: DeviceKV, sync: Sync) -> Timing:
    t0 = time.perf_counter()
    with sync.on_load():
        host.copy_layers(kv, range(host.geom.layers))
    sync.synchronize()
    return Timing(time.perf_counter() - t0)


def load_all(pool: SharedPool, keys: Sequence[PageKey], host: HostKV, kv: DeviceKV, model: StandIn,
             sync: Sync, plan: LayerPlan) -> Timing:
    runs = host.runs()
    t0 = time.perf_counter()
    ok = all(pool.get(list(keys), runs))
    read_s = time.perf_counter() - t0
    chunks = host.load_chunks(plan)
    events: list[Any] = []
    chunk_of: dict[int, int] = {}
    for i, layers in enumerate(chunks):  # queued at once: the load stream runs ahead of the compute
        with sync.on_load():
            host.copy_layers(kv, layers)
            events.append(sync.record())
        chunk_of |= {layer: i for layer in layers}
    _layers(model, kv, sync, lambda layer: sync.wait(events[chunk_of[layer]]))
    return Timing(time.perf_counter() - t0, read_s=read_s, ok=ok)


def streamed(pool: SharedPool, keys: Sequence[PageKey], host: HostKV, kv: DeviceKV, model: StandIn, sync: Sync,
             plan: LayerPlan) -> Timing:
    groups = plan.group_count
    ready = [threading.Event() for _ in range(groups)]
    events: list[Any] = [None] * groups
    landed = [False] * groups
    landed_at = [0.0] * groups
    failure: list[BaseException] = []
    runs = host.runs()

    def on_part(group: int, ok: list[bool]) -> None:
        landed[group] = all(ok)
        if landed[group]:  # verified in host memory: only now may its bytes go to the device
            with sync.on_load():
                host.copy_layers(kv, plan.layers(group))
                events[group] = sync.record()
        landed_at[group] = time.perf_counter() - t0
        ready[group].set()

    def reader() -> None:
        try:
            pool.get_parts(list(keys), runs, on_part, groups=plan.groups)
        except BaseException as exc:  # noqa: BLE001 - handed to the compute thread, re-raised there
            failure.append(exc)
        finally:
            for e in ready:
                e.set()  # a reader that stopped early must not leave the compute thread waiting

    waited = [0.0]

    def before(layer: int) -> None:
        g = plan.group_of(layer)
        if not ready[g].is_set():
            w0 = time.perf_counter()
            if not ready[g].wait(GROUP_TIMEOUT_S):
                raise TimeoutError(f"layer group {g} did not land within {GROUP_TIMEOUT_S:.0f} s")
            waited[0] += time.perf_counter() - w0
        sync.wait(events[g])

    t0 = time.perf_counter()
    thread = threading.Thread(target=reader, name="gpu-stream-reader", daemon=True)
    thread.start()
    try:
        _layers(model, kv, sync, before)
    finally:
        thread.join(GROUP_TIMEOUT_S)
    if failure:
        raise failure[0]
    return Timing(time.perf_counter() - t0, waited_s=waited[0], group_landed_s=list(landed_at), ok=all(landed))
