"""Layer groups of a host pool's pages: the checksummed parts (``Namespace.parts``) the adapter chooses, and
which parts form each layer group, for reads verified group by group (``store.part_reads``).

A stored page is the pool's flat page (``host_pages``). In MHA ``layer_first`` / ``page_first_direct`` (flat
page ``(2, L, ps, H, D)``: K of layers 0..L-1, then V) and MLA ``layer_first`` / ``page_first_direct`` (flat
page ``(L, ps, 1, Dkv)``) each layer's bytes of a page are one contiguous range, layers in order. Such a pool
is *streamable*: its L layers are cut into G groups (``choose_groups``), group g holding layers
``[bounds[g], bounds[g + 1])``; each (group, K|V range) is one part, in page order (MHA: K g0..K g(G-1),
V g0..V g(G-1), layer group g being parts ``[g, G + g]``; MLA: G parts). G: the most groups in 4..8 (at most
L) whose smallest IO, one group's layers of one range of one page, is at least ``MIN_IO_BYTES``, else the fewest.

Every other layout (a strided or token-major layer group, pages copied rather than read in place, another
shape, one layer) keeps one part; ``unstreamable`` says why, logged once per layout and reason. The choice
depends only on the pool's geometry, so every rank and restart of one deployment chooses the same parts
(part of the namespace's identity when there are several).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Cuts = tuple[int, ...]  # read group r is stored layer groups [cuts[r], cuts[r + 1]); cuts[0] = 0, cuts[-1] = G


def even_cuts(stored_groups: int, count: int) -> Cuts:
    """``count`` read groups of ``stored_groups`` as even as can be (sizes differ by at most one)."""
    return tuple(g * stored_groups // count for g in range(count + 1))


log = logging.getLogger(__name__)

MIN_GROUPS, MAX_GROUPS = 4, 8
MIN_IO_BYTES = 128 << 10
MHA_LAYER_AXIS = {"layer_first": 1, "page_first_direct": 2}  # the layer axis of the page's (unflattened) view
MLA_LAYER_AXIS = {"layer_first": 0, "page_first_direct": 1}
_said: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class LayerPlan:
    """The parts of a streamable pool's pages and the layer groups they form."""

    layout: str
    num_layers: int
    ranges: int  # ranges per layer of a page: 2 (K, V) for MHA, 1 for MLA
    layer_bytes: int  # one layer's bytes of one range of one page
    bounds: tuple[int, ...]  # group g holds layers [bounds[g], bounds[g + 1]); bounds[0] = 0, bounds[-1] = L

    @property
    def group_count(self) -> int:
        """G, the number of layer groups."""
        return len(self.bounds) - 1

    @property
    def page_bytes(self) -> int:
        """The bytes of one page."""
        return self.ranges * self.num_layers * self.layer_bytes

    @property
    def parts(self) -> tuple[int, ...]:
        """Each part's byte length in page order (``Namespace.parts``)."""
        sizes = tuple((b - a) * self.layer_bytes for a, b in zip(self.bounds, self.bounds[1:]))
        return sizes * self.ranges

    @property
    def groups(self) -> list[list[int]]:
        """Per layer group, the indices of its parts (``get_parts``' ``groups``)."""
        g = self.group_count
        return [[r * g + i for r in range(self.ranges)] for i in range(g)]

    def layers(self, group: int) -> range:
        """The layers of layer group ``group``."""
        return range(self.bounds[group], self.bounds[group + 1])

    def group_of(self, layer: int) -> int:
        """The layer group holding ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is not in 0..{self.num_layers - 1}")
        return next(g for g in range(self.group_count) if layer < self.bounds[g + 1])

    def part_range(self, part: int) -> tuple[int, int]:
        """``(offset, length)`` of part ``part`` in the page."""
        sizes = self.parts
        return sum(sizes[:part]), sizes[part]

    def reads(self, count: int) -> ReadPlan:
        """How to read these pages in ``count`` read groups (clamped to 1..``group_count``): the layer groups
        merged in order, as evenly as can be (``ReadPlan``)."""
        count = max(1, min(int(count), self.group_count))
        return ReadPlan(self, even_cuts(self.group_count, count))

    def read_in(self, cuts: Sequence[int]) -> ReadPlan:
        """How to read these pages in the read groups ``cuts`` (``Cuts``: read group r is layer groups
        ``[cuts[r], cuts[r + 1])``). Raises ValueError for cuts that are not ``0 < .. < G``."""
        cut = tuple(int(c) for c in cuts)
        g = self.group_count
        if len(cut) < 2 or cut[0] != 0 or cut[-1] != g or any(a >= b for a, b in zip(cut, cut[1:])):
            raise ValueError(f"read cuts must rise from 0 to {g}, got {cut}")
        return ReadPlan(self, cut)


@dataclass(frozen=True)
class ReadPlan:
    """One streamed read of a ``LayerPlan``'s pages in fewer, larger groups: read group r is the stored layer
    groups ``[cuts[r], cuts[r + 1])``. The stored parts and their checksums are the plan's (the namespace does
    not change); a read group's parts of one range are consecutive in the page, so ``store.part_reads``
    reads them as one IO per page and range, each part still verified on its own. Fewer read groups: fewer
    IOs (less CPU per hit) and a longer wait for the first group (``experiments.streaming.rules.read_groups``)."""

    stored: LayerPlan
    cuts: tuple[int, ...]

    @property
    def group_count(self) -> int:
        """The number of read groups."""
        return len(self.cuts) - 1

    @property
    def parts(self) -> tuple[int, ...]:
        """The stored parts' byte lengths (the ``LayerPlan``'s)."""
        return self.stored.parts

    @property
    def groups(self) -> list[list[int]]:
        """Per read group, the indices of its parts, in page order."""
        stored = self.stored.groups
        return [sorted(p for g in range(a, b) for p in stored[g]) for a, b in zip(self.cuts, self.cuts[1:])]

    def layers(self, group: int) -> range:
        """The layers of read group ``group``."""
        bounds = self.stored.bounds
        return range(bounds[self.cuts[group]], bounds[self.cuts[group + 1]])


def choose_groups(num_layers: int, layer_bytes: int, lo: int = MIN_GROUPS, hi: int = MAX_GROUPS,
                  min_io: int = MIN_IO_BYTES) -> int:
    """How many layer groups (module docstring): the most in ``lo..hi`` (at most ``num_layers``) whose
    smallest group (``num_layers // G`` layers) makes an IO of at least ``min_io``, else the fewest."""
    top = min(hi, num_layers)
    bottom = min(lo, top)
    for g in range(top, bottom - 1, -1):
        if (num_layers // g) * layer_bytes >= min_io:
            return g
    return bottom


def plan_for(pages: Any, groups: int | None = None) -> LayerPlan | None:
    """The layer plan of a registered pool (``HostPages``), or None: its pages keep one part (``unstreamable``
    says why). ``groups``: force G (tests); default ``choose_groups``."""
    return _plan(pages, groups)[0]


def unstreamable(pages: Any) -> str | None:
    """Why ``pages`` keeps one part (None: it streams); logged once per layout and reason."""
    plan, why = _plan(pages, None)
    if plan is not None:
        return None
    key = (str(getattr(pages, "layout", "?")), why)
    if key not in _said:
        _said.add(key)
        log.info("kvtier: host layout %s does not stream in layer groups (%s): its pages keep one checksummed "
                 "part and load whole", key[0], why)
    return why


def _plan(pages: Any, groups: int | None) -> tuple[LayerPlan | None, str]:
    """``(plan, "")`` for a streamable pool, else ``(None, why)``."""
    pool = getattr(pages, "pool", None)
    if pool is None:
        return None, "no host pool"
    layout = str(getattr(pool, "layout", ""))
    axes = MLA_LAYER_AXIS if pages.mla else MHA_LAYER_AXIS
    if layout not in axes:
        return None, "a layer group of a page is not contiguous in this layout"
    if getattr(pages.access, "value", None) != "zero_copy":
        return None, "the pool's pages are copied, not read in place"
    num_layers = int(getattr(pool, "layer_num", 0) or 0)
    ranges = 1 if pages.mla else 2
    try:
        shape = tuple(pool.get_data_page(0, flat=False).shape)
    except (AttributeError, NotImplementedError, ValueError, AssertionError, IndexError) as exc:
        return None, f"its page view is unavailable ({exc!r})"
    axis = axes[layout]
    # Before the layer axis: the K|V axis (MHA: 2; MLA: none) and single-page axes only.
    lead = shape[:axis]
    expected_lead = ((2,) + (1,) * (axis - 1)) if ranges == 2 else (1,) * axis
    if num_layers < 2 or len(shape) <= axis or shape[axis] != num_layers or lead != expected_lead:
        return None, f"page view {shape} is not {ranges} range(s) x {num_layers} layers (or one layer only)"
    if pages.page_bytes % (ranges * num_layers):
        return None, f"{pages.page_bytes}-byte pages do not divide into {ranges} x {num_layers} layers"
    layer_bytes = pages.page_bytes // (ranges * num_layers)
    g = choose_groups(num_layers, layer_bytes) if groups is None else groups
    if not 1 <= g <= num_layers:
        raise ValueError(f"groups must be in 1..{num_layers}, got {g}")
    return LayerPlan(layout, num_layers, ranges, layer_bytes, even_cuts(num_layers, g)), ""
