"""Where a page of an SGLang host pool lives in memory, as runs the page store can move zero-copy.

Canonical byte order of a stored page = the pool's flat page order (``get_data_page(i, flat=True)``),
so the zero-copy v1 path and the legacy copy path read and write identical bytes:
  * MHA page_first / page_first_direct / page_head: [K run, V run] (``get_page_buffer_meta`` order);
  * MHA layer_first: ``get_page_buffer_meta`` gives K0,V0,K1,V1,...; the flat order is K0..K(L-1),
    V0..V(L-1), so the runs are reordered to that;
  * MLA page_first(_direct): one run; MLA layer_first: one run per layer, in layer order.
Pools whose flat page is not a view of their memory (Mamba, ...) use the *copy* strategy: write from
``get_data_page(flat=True)``, read into ``get_dummy_flat_data_page()`` then ``set_from_flat_data_page``. The
strategy is chosen once per pool and checked against the flat page. Zero-copy pools whose layer groups are
contiguous get a ``plan`` (``parts_plan``).

A zero-copy pool's pages are one page's runs shifted (``RunTemplate``), found once per pool and checked
against ``get_page_buffer_meta`` on a spread of its pages; a hit's runs are then computed from its pages'
first slots, not asked of SGLang page by page. A pool where the check fails keeps asking SGLang.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sgl_kvtier.io.buffers import Run
from sgl_kvtier.sglang.parts_plan import LayerPlan, plan_for


class Access(enum.Enum):
    """How a pool's pages move: straight from/into its memory, or through its flat-page copy calls."""

    ZERO_COPY = "zero_copy"
    COPY = "copy"


@dataclass(frozen=True)
class RunTemplate:
    """A pool's pages as one page's runs shifted: the page at first slot ``s`` is ``runs`` moved by ``s //
    page_tokens * stride`` bytes."""

    runs: tuple[Run, ...]
    stride: int
    page_tokens: int

    SAMPLE = 64  # pages checked across the pool (plus the first four)

    @classmethod
    def of(cls, meta: Callable[[int], list[Run]], pages: int, page_tokens: int) -> RunTemplate | None:
        """The template of a pool of ``pages`` pages whose page ``i``'s runs are ``meta(i)``, or None where
        a sampled page is not the first page's runs shifted by ``i`` strides."""
        if pages < 2:
            return None
        first = meta(0)
        stride = meta(1)[0][0] - first[0][0]
        template = cls(tuple(first), stride, page_tokens)
        step = max(1, pages // cls.SAMPLE)
        for i in sorted(i for i in {1, 2, 3, pages - 1, *range(0, pages, step)} if i < pages):
            if meta(i) != template.page(i * page_tokens):
                return None
        return template

    def page(self, start: int) -> list[Run]:
        """The runs of the page whose first slot is ``start``."""
        shift = start // self.page_tokens * self.stride
        return [(a + shift, n) for a, n in self.runs]


def tensor_run(t: torch.Tensor) -> Run:
    """The one memory run of a contiguous tensor: ``(address, bytes)``."""
    if not t.is_contiguous():
        raise ValueError("a page buffer must be contiguous")
    return (t.data_ptr(), t.numel() * t.element_size())


@dataclass
class HostPages:
    """Page geometry and memory access of one registered host pool."""

    pool: Any
    page_tokens: int
    page_bytes: int
    access: Access
    mla: bool
    # The layer groups of a streamable layout (``parts_plan``): the KV pool's parts and read groups; None:
    # one part.
    plan: LayerPlan | None = None
    template: RunTemplate | None = None  # a zero-copy pool's pages as one page's runs shifted (or None)

    @classmethod
    def of(cls, pool: Any) -> HostPages:
        """The geometry of ``pool`` and the access strategy its layout allows (checked on the padding page)."""
        page_tokens = int(pool.page_size)
        mla = hasattr(pool, "kv_lora_rank") or type(pool).__name__.startswith("MLA")
        flat = pool.get_dummy_flat_data_page()
        page_bytes = flat.numel() * flat.element_size()
        hp = cls(pool, page_tokens, page_bytes, Access.COPY, mla)
        try:
            runs = hp._page_meta(0)
        except (AttributeError, NotImplementedError, ValueError, AssertionError):
            return hp
        if sum(n for _, n in runs) == page_bytes and hp._matches_flat_order(runs):
            hp.access = Access.ZERO_COPY
            hp.template = RunTemplate.of(hp._page_meta, int(getattr(pool, "size", 0)) // page_tokens, page_tokens)
        hp.plan = plan_for(hp)
        return hp

    def bytes_of(self, tokens: int) -> int:
        """Bytes of the whole pages in ``tokens`` slots (a hit or a tail: whole pages)."""
        return tokens // self.page_tokens * self.page_bytes

    @property
    def layout(self) -> str:
        """The pool layout (``mla:`` prefixed for MLA pools), part of the namespace."""
        return ("mla:" if self.mla else "") + str(getattr(self.pool, "layout", "unknown"))

    @property
    def dtype(self) -> str:
        """The KV dtype without ``torch.``, part of the namespace."""
        return str(getattr(self.pool, "dtype", "unknown")).replace("torch.", "")

    def _page_meta(self, page: int) -> list[Run]:
        """Page ``page``'s runs (the pool's slots ``page * page_tokens`` on), as SGLang's meta gives them."""
        start = page * self.page_tokens
        return self._meta_runs(torch.arange(start, start + self.page_tokens, dtype=torch.int64))[0]

    def _meta_runs(self, host_indices: torch.Tensor) -> list[list[Run]]:
        """Each page's runs from SGLang's ``get_page_buffer_meta``, in flat page order."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        n_pages = len(host_indices) // self.page_tokens
        per_page = len(ptrs) // n_pages
        pages = []
        for p in range(n_pages):
            runs = list(zip(ptrs[p * per_page:(p + 1) * per_page], sizes[p * per_page:(p + 1) * per_page]))
            if getattr(self.pool, "layout", None) == "layer_first" and not self.mla and per_page > 2:
                runs = runs[0::2] + runs[1::2]  # K0,V0,K1,V1.. -> K0,K1,..,V0,V1,.. (flat page order)
            pages.append(runs)
        return pages

    def _matches_flat_order(self, runs: Sequence[Run]) -> bool:
        """Check on the padding page that concatenating the runs gives the flat page's bytes."""
        view = self.pool.get_data_page(0, flat=False)
        if view.data_ptr() != runs[0][0]:
            return False
        marker = torch.arange(view.numel() * view.element_size(), dtype=torch.int64) % 251
        before = self.pool.get_data_page(0, flat=True).clone()
        try:
            self.pool.set_from_flat_data_page(0, marker.to(torch.uint8).view(before.dtype))
            stored = b"".join(ctypes.string_at(a, n) for a, n in runs)
            return stored == marker.to(torch.uint8).numpy().tobytes()
        finally:
            self.pool.set_from_flat_data_page(0, before)

    def page_runs(self, host_indices: torch.Tensor) -> list[list[Run]]:
        """Runs of each page of ``host_indices`` (``len == pages * page_tokens``); zero-copy pools only."""
        if self.template is not None:
            return [self.template.page(s) for s in self.page_starts(host_indices)]
        return self._meta_runs(host_indices)

    def page_starts(self, host_indices: torch.Tensor) -> list[int]:
        """The first host slot of each page of ``host_indices``."""
        return host_indices[::self.page_tokens].tolist()


def check_indices(host_indices: Any, n_keys: int, page_tokens: int) -> str | None:
    """Why ``host_indices`` cannot carry ``n_keys`` pages, or None when it can."""
    if not isinstance(host_indices, torch.Tensor):
        return f"host_indices must be a tensor, got {type(host_indices).__name__}"
    if host_indices.dim() != 1 or host_indices.numel() != n_keys * page_tokens:
        return f"host_indices has {host_indices.numel()} slots, {n_keys} pages need {n_keys * page_tokens}"
    starts = host_indices[::page_tokens]
    if bool((starts % page_tokens != 0).any()):
        return "host_indices do not start on page boundaries"
    return None
