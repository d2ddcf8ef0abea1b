"""gpu_stream's store side: one sgl-kvtier ``SharedPool`` per (geometry, layer groups, host layout), the host
landing buffer its reads go into (pinned on a GPU machine), and the device KV the loads copy to.

Host layouts (what SGLang's host pool would be):
- ``layer_first``: ``[2, L, P, layer_bytes]``: a page is 2L runs (K of each layer, then V); layer l's K of
  every page is one contiguous range, so one host -> device copy per layer and K|V;
- ``page_first_direct``: ``[P, 2, L, layer_bytes]``: a page is one run; a layer group of a page is one
  contiguous range per K|V, so one copy per page, group and K|V (SGLang's per-page ``direct`` loop; here
  each is a torch copy issued from Python, so their launch cost is in the timings).
Device KV: ``[2, L, P * layer_bytes]`` bytes (K|V, layer, the prefix's tokens in page order), as SGLang's
per-layer device pool holds a request's prefix.

Pages are written once per pool (``write_pages``) from the *canonical* bytes ``[2, L, P, layer_bytes]``
(random values in the KV dtype), which are also what a load must put on the device (``Device KV`` equal
to them, byte for byte: ``DeviceKV.matches``). Every read is through the store's verified path: ``get``
(whole pages) or ``get_parts`` (group-major, each group verified before ``on_part``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.geometry import Geometry
from sgl_kvtier.config import StoreConfig
from sgl_kvtier.io.buffers import ALIGN
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.sglang.parts_plan import LayerPlan
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.store import format as fmt

LAYOUTS = ("layer_first", "page_first_direct")
PUT_BATCH = 128  # pages per put call, as SGLang's backup batches
SLOW_IO_S = 600.0  # a throttled device is slow by design: the breaker must not take it for a failing one


def aligned_bytes(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of uint8 memory starting at a 4 KiB boundary (O_DIRECT reads land in place), pinned if asked."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


def canonical_pages(geom: Geometry, seed: int = 0, device: torch.device | None = None) -> torch.Tensor:
    """``[2, L, P, layer_bytes]`` bytes of random KV values in the geometry's dtype, made on ``device``
    (default the CPU; a GPU makes a 64k-token prefix in a moment)."""
    device = device or torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty((2, geom.layers, geom.pages, geom.layer_bytes), dtype=torch.uint8, device=device)
    elems = geom.pages * geom.layer_bytes // geom.itemsize
    dtype = getattr(torch, geom.kv_dtype)
    for kv in range(2):
        for layer in range(geom.layers):  # one layer at a time: no temporaries the size of the prefix
            vals = torch.randn(elems, generator=gen, device=device).to(dtype)
            out[kv, layer] = vals.view(torch.uint8).view(geom.pages, geom.layer_bytes)
    return out


class HostKV:
    """The landing buffer of one hit's P pages in ``layout`` (module docstring)."""

    def __init__(self, geom: Geometry, layout: str, pin: bool):
        if layout not in LAYOUTS:
            raise ValueError(f"host layout {layout!r}: expected one of {LAYOUTS}")
        self.geom, self.layout = geom, layout
        shape = (2, geom.layers, geom.pages, geom.layer_bytes) if layout == "layer_first" else \
            (geom.pages, 2, geom.layers, geom.layer_bytes)
        self.data = aligned_bytes(geom.prefix_bytes, pin).view(shape)

    def runs(self) -> list[list[tuple[int, int]]]:
        """Per page, its runs in flat page order (K layers 0..L-1, then V)."""
        g, base = self.geom, self.data.data_ptr()
        if self.layout == "page_first_direct":
            return [[(base + i * g.page_bytes, g.page_bytes)] for i in range(g.pages)]
        stride_layer = g.pages * g.layer_bytes
        return [[(base + (kv * g.layers + layer) * stride_layer + i * g.layer_bytes, g.layer_bytes)
                 for kv in range(2) for layer in range(g.layers)] for i in range(g.pages)]

    def fill(self, canonical: torch.Tensor) -> None:
        """Put the canonical bytes ``[2, L, P, lb]`` (on any device) in this layout."""
        self.data.copy_(canonical if self.layout == "layer_first" else canonical.permute(2, 0, 1, 3))

    def zero(self) -> None:
        self.data.zero_()

    def load_chunks(self, plan: LayerPlan) -> list[range]:
        """The layer runs the load-all path copies one at a time, each followed by an event: one layer in
        ``layer_first`` (one copy per layer and K|V), one layer group of ``plan`` in ``page_first_direct``
        (a copy per page, group and K|V: per layer it would be P x 2L copies)."""
        if self.layout == "layer_first":
            return [range(layer, layer + 1) for layer in range(self.geom.layers)]
        return [plan.layers(g) for g in range(plan.group_count)]

    def copy_layers(self, dev: DeviceKV, layers: range) -> None:
        """Queue host -> device copies of ``layers`` (both K and V) on the current stream (non-blocking)."""
        g = self.geom
        if self.layout == "layer_first":
            for kv in range(2):
                for layer in layers:
                    dev.data[kv, layer].copy_(self.data[kv, layer].view(-1), non_blocking=True)
            return
        a, b = layers.start, layers.stop
        for kv in range(2):
            for i in range(g.pages):
                dst = dev.data[kv, a:b, i * g.layer_bytes:(i + 1) * g.layer_bytes]
                dst.copy_(self.data[i, kv, a:b], non_blocking=True)


class DeviceKV:
    """The prefix's KV on the compute device: ``[2, L, P * layer_bytes]`` bytes."""

    def __init__(self, geom: Geometry, device: torch.device):
        self.geom = geom
        self.data = torch.zeros((2, geom.layers, geom.pages * geom.layer_bytes), dtype=torch.uint8, device=device)

    def layer(self, kv: int, layer: int) -> torch.Tensor:
        """``[P * page_tokens, kv_heads, head_dim]`` of layer ``layer``'s K (kv 0) or V (kv 1), in the KV dtype."""
        g = self.geom
        return self.data[kv, layer].view(getattr(torch, g.kv_dtype)).view(-1, g.kv_heads, g.head_dim)

    def zero(self) -> None:
        self.data.zero_()

    def matches(self, expected: torch.Tensor) -> bool:
        """Byte-equal to ``expected`` (``[2, L, P * layer_bytes]`` on the same device)."""
        return bool(torch.equal(self.data, expected))


def page_keys(geom: Geometry, count: int) -> list[PageKey]:
    return [PageKey(hashlib.sha256(f"gpu-stream/{geom.name}/{i}".encode()).digest()) for i in range(count)]


def namespace(geom: Geometry, plan: LayerPlan, layout: str) -> Namespace:
    """The pool's namespace: the page geometry, the host layout and its checksummed parts (one per group and K|V)."""
    return Namespace(model=f"gpu-stream-{geom.name}", dtype=geom.kv_dtype, layout=layout,
                     page_tokens=geom.page_tokens, page_bytes=geom.page_bytes, parts=plan.parts)


def store_config(root: Path, geom: Geometry, plan: LayerPlan, read_bytes_per_s: float | None,
                 io_depth: int) -> StoreConfig:
    """One directory device with room for the hit (and some slack); reads throttled if a rate is given."""
    slot = fmt.slot_bytes_for(geom.page_bytes, len(plan.parts))
    capacity = (geom.pages + 16) * slot
    keys: dict[str, Any] = {"devices": [str(root)], "capacity_bytes": capacity, "io_depth": io_depth,
                            "segment_bytes": max(1 << 20, min(256 << 20, -(-capacity // ALIGN) * ALIGN))}
    if read_bytes_per_s is not None:
        keys |= {"throttle": {"read_bytes_per_s": read_bytes_per_s}, "slow_io_s": SLOW_IO_S}
    return StoreConfig.from_mapping(keys)


def open_pool(root: Path, geom: Geometry, plan: LayerPlan, layout: str, read_bytes_per_s: float | None = None,
              io_depth: int = 32) -> SharedPool:
    root.mkdir(parents=True, exist_ok=True)
    return SharedPool.open_writer(store_config(root, geom, plan, read_bytes_per_s, io_depth),
                                  namespace(geom, plan, layout))


def write_pages(pool: SharedPool, keys: Sequence[PageKey], host: HostKV) -> int:
    """Store the pages now in ``host`` under ``keys``; returns how many were stored (all, or a failure)."""
    runs = host.runs()
    stored = 0
    for start in range(0, len(keys), PUT_BATCH):
        stored += sum(pool.put(keys[start:start + PUT_BATCH], runs[start:start + PUT_BATCH]))
    return stored
