"""Layer-group reads of a KV host shard's pages straight into host slots: the read side of a streamed L3 tail.

``read_layer_groups(shard, keys, host_indices, on_group, reads)`` reads the pages of ``keys`` into the host
slots ``host_indices`` (page-aligned, ``len == pages * page_tokens``) group-major (``PoolView.get_parts``
with the groups of ``reads``, a ``ReadPlan`` of the pool's ``LayerPlan``; None: one read group per layer
group): read group 0 of every page, verified, then ``on_group(0, layers, ok)``, then group 1, ... While
``on_group(g)`` runs, group g + 1 is in flight; later groups are not read yet. ``ok[i]``: page ``i`` has every
part of groups 0..g verified in its slots (a page failing a part in group g gets no IO from group g + 2 on,
and its slots then hold bytes that must not be used). Returns, per page, whether it was read whole and
verified.

Only host shards whose pool streams (``HostPages.plan``) and moves zero-copy are read this way; any other
raises ``KVTierError`` (callers load those pages whole).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sgl_kvtier.errors import KVTierError
from sgl_kvtier.keys import PageKey
from sgl_kvtier.sglang.host_pages import Access, check_indices
from sgl_kvtier.sglang.host_shard import HostShard
from sgl_kvtier.sglang.parts_plan import ReadPlan

OnGroup = Callable[[int, range, list[bool]], None]  # (read group, its layers, per page: verified so far)


def read_layer_groups(shard: HostShard, keys: Sequence[PageKey], host_indices: torch.Tensor,
                      on_group: OnGroup, reads: ReadPlan | None = None) -> list[bool]:
    """Read ``keys`` into ``host_indices`` read group by read group (module docstring)."""
    plan = shard.pages.plan
    if plan is None or shard.pages.access is not Access.ZERO_COPY or shard.namespace.parts != plan.parts:
        raise KVTierError(f"pool {shard.name} ({shard.pages.layout}) does not stream in layer groups")
    if reads is not None and reads.stored != plan:
        raise ValueError("the read plan is not of this pool's layer groups")
    problem = check_indices(host_indices, len(keys), shard.pages.page_tokens)
    if problem is not None:
        raise ValueError(problem)
    store = shard.store
    if store is None:
        raise KVTierError(f"shard {shard.namespace.dirname()} is not open")
    if not keys:
        return []

    read = reads if reads is not None else plan.reads(plan.group_count)

    def on_part(group: int, ok: list[bool]) -> None:
        on_group(group, read.layers(group), ok)

    return store.get_parts(list(keys), shard.pages.page_runs(host_indices), on_part, groups=read.groups)
