"""The adapter's layer-group parts (``sglang.parts_plan``) on SGLang's real host pools: streamable layouts get
one checksummed part per (layer group, K|V range) on layer boundaries, round trips stay byte-exact, and a
group-major read (``read_layer_groups``) hands over exactly layer group g's bytes; other layouts keep one part."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from pools import fill_random, mha_host_pool, mla_host_pool, page_bytes, zero  # noqa: E402
from test_storage_adapter import PS, chain_keys, make_backend, slots  # noqa: E402

from sgl_kvtier.errors import KVTierError  # noqa: E402
from sgl_kvtier.keys import parse_keys  # noqa: E402
from sgl_kvtier.sglang.group_reads import read_layer_groups  # noqa: E402
from sgl_kvtier.sglang.host_pages import HostPages  # noqa: E402
from sgl_kvtier.sglang.parts_plan import choose_groups, plan_for  # noqa: E402

STREAMABLE = [("mha", "layer_first"), ("mha", "page_first_direct"), ("mla", "page_first_direct"), ("mla", "layer_first")]
UNSTREAMABLE = [("mha", "page_first"), ("mha", "page_head"), ("mla", "page_first")]


def make_pool(kind: str, layout: str, layers: int = 8):
    if kind == "mla":
        return mla_host_pool(layout, layers=layers, kv_lora_rank=448, rope=64, tokens=256)
    return mha_host_pool(layout, layers=layers, heads=4, head_dim=64, tokens=256)


def host_layer(pool, kind: str, start: int, rng: int, layer: int) -> bytes:
    """Layer ``layer``'s bytes (K: rng 0, V: rng 1; MLA: one range) of the page at slot ``start``, taken from
    the host pool's buffer by its documented dims (not through the flat page)."""
    ps, layout, buf = pool.page_size, pool.layout, pool.kv_buffer
    if kind == "mla":
        t = buf[layer, start:start + ps] if layout == "layer_first" else buf[start // ps, layer]
    else:
        t = buf[rng, layer, start:start + ps] if layout == "layer_first" else buf[rng, start // ps, layer]
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def group_bytes(pool, kind: str, plan, start: int, group: int, rng: int) -> bytes:
    return b"".join(host_layer(pool, kind, start, rng, layer) for layer in plan.layers(group))


@dataclass
class Stored:
    """Six chained pages stored from host slots ``src`` of a random pool, to be read back into ``dst``."""

    pool: Any
    backend: Any
    keys: list[str]
    src: list[int]
    dst: list[int]
    ranges: int  # K|V ranges per layer group: 2 (MHA) or 1 (MLA)

    @property
    def plan(self) -> Any:
        return self.backend.kv.pages.plan


@contextmanager
def stored_pages(tmp_path, kind: str, layout: str, seed: int) -> Iterator[Stored]:
    """``Stored`` pages on a backend without read-ahead; the pool is zeroed after the write; closed after."""
    pool = make_pool(kind, layout)
    fill_random(pool, seed=seed)
    backend = make_backend(tmp_path, pool, mla=kind == "mla", readahead_bytes=0)
    try:
        got = Stored(pool, backend, chain_keys(6), [2, 9, 4, 11, 6, 13], [20, 25, 21, 30, 22, 31],
                     1 if kind == "mla" else 2)
        yield got
    finally:
        backend.close()


def test_choose_groups_follows_the_geometry() -> None:
    assert choose_groups(64, 16 << 10) == 8  # kvheavy: 8 layers x 16 KiB = 128 KiB per IO
    assert choose_groups(62, 8 << 10) == 4  # 480B TP8: no G in 4..8 reaches 128 KiB: the fewest, 120 KiB IOs
    assert choose_groups(64, 64 << 10) == 8 and choose_groups(64, 4 << 10) == 4
    assert choose_groups(40, 16 << 10) == 5  # 8 layers x 16 KiB at G = 5; G = 6..8 fall short
    assert choose_groups(2, 4 << 10) == 2 and choose_groups(3, 1 << 20) == 3  # never more groups than layers


def test_kvheavy_pool_gets_eight_groups_of_128_kib() -> None:
    pool = mha_host_pool("layer_first", layers=64, heads=8, head_dim=64, tokens=64)
    plan = HostPages.of(pool).plan
    assert plan is not None and plan.group_count == 8 and plan.parts == (128 << 10,) * 16
    assert plan.groups[0] == [0, 8] and plan.groups[7] == [7, 15]


@pytest.mark.parametrize("layers", [8, 5])
@pytest.mark.parametrize(("kind", "layout"), STREAMABLE)
def test_streamable_parts_fall_on_layer_boundaries(tmp_path, kind, layout, layers) -> None:
    pool = make_pool(kind, layout, layers)
    fill_random(pool, seed=3)
    backend = make_backend(tmp_path, pool, mla=kind == "mla")
    try:
        ns, plan = backend.kv.namespace, backend.kv.pages.plan
        assert plan is not None and ns.parts == plan.parts and sum(ns.parts) == ns.page_bytes
        ranges = 1 if kind == "mla" else 2
        assert len(ns.parts) == ranges * plan.group_count and 4 <= plan.group_count <= min(8, layers)
        assert sorted(p for g in plan.groups for p in g) == list(range(len(ns.parts)))
        for start in (0, 5 * PS, 17 * PS):
            flat = page_bytes(pool, start)
            for g, parts in enumerate(plan.groups):
                assert len(parts) == ranges
                for rng, part in enumerate(parts):
                    offset, length = plan.part_range(part)
                    assert offset % plan.layer_bytes == 0 and length % plan.layer_bytes == 0
                    assert flat[offset:offset + length] == group_bytes(pool, kind, plan, start, g, rng)
    finally:
        backend.close()


@pytest.mark.parametrize("readahead", [0, 64 << 20])
@pytest.mark.parametrize(("kind", "layout"), STREAMABLE)
def test_round_trip_through_the_adapter_is_byte_exact(tmp_path, kind, layout, readahead) -> None:
    pool = make_pool(kind, layout)
    fill_random(pool, seed=4)
    backend = make_backend(tmp_path, pool, mla=kind == "mla", readahead_bytes=readahead)
    try:
        assert backend.kv.namespace.parts  # several parts: the per-part checksums are on the path
        keys, src, dst = chain_keys(10), [3, 17, 5, 20, 21, 9, 30, 2, 13, 11], [1, 4, 6, 7, 8, 10, 12, 14, 15, 16]
        expected = [page_bytes(pool, p * PS) for p in src]
        assert backend.batch_set_v1(keys, slots(src)) == [True] * 10
        assert backend.batch_exists(keys) == 10
        zero(pool)
        assert backend.batch_get_v1(keys, slots(dst)) == [True] * 10
        assert [page_bytes(pool, p * PS) for p in dst] == expected
        assert backend.telemetry().boundary.total == 0
    finally:
        backend.close()


@pytest.mark.parametrize(("kind", "layout"), STREAMABLE)
def test_group_major_read_hands_over_each_layer_group_exactly(tmp_path, kind, layout) -> None:
    with stored_pages(tmp_path, kind, layout, seed=5) as st:
        pool, shard, plan, keys, src, dst, ranges = st.pool, st.backend.kv, st.plan, st.keys, st.src, st.dst, st.ranges
        want = {(p, g, r): group_bytes(pool, kind, plan, p * PS, g, r)
                for p in src for g in range(plan.group_count) for r in range(ranges)}
        assert st.backend.batch_set_v1(keys, slots(src)) == [True] * 6
        zero(pool)
        seen: list[int] = []

        def on_group(g: int, layers: range, ok: list[bool]) -> None:
            assert list(layers) == list(plan.layers(g)) and ok == [True] * 6
            seen.append(g)
            for s, d in zip(src, dst):
                for r in range(ranges):
                    assert group_bytes(pool, kind, plan, d * PS, g, r) == want[(s, g, r)]
                    for later in range(g + 2, plan.group_count):  # not read yet (g + 1 may be in flight)
                        assert group_bytes(pool, kind, plan, d * PS, later, r) == bytes(len(want[(s, later, r)]))

        assert read_layer_groups(shard, parse_keys(keys), slots(dst), on_group) == [True] * 6
        assert seen == list(range(plan.group_count))
        for s, d in zip(src, dst):
            for g in range(plan.group_count):
                for r in range(ranges):
                    assert group_bytes(pool, kind, plan, d * PS, g, r) == want[(s, g, r)]


def test_read_plans_merge_layer_groups_in_order() -> None:
    plan = plan_for(HostPages.of(make_pool("mha", "layer_first", layers=8)), groups=8)
    assert plan is not None
    three = plan.reads(3)
    assert three.cuts == (0, 2, 5, 8) and three.group_count == 3 and three.parts == plan.parts
    assert three.groups == [[0, 1, 8, 9], [2, 3, 4, 10, 11, 12], [5, 6, 7, 13, 14, 15]]  # K parts, then V parts
    assert [list(three.layers(r)) for r in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert plan.reads(8).groups == plan.groups and [list(plan.reads(8).layers(g)) for g in range(8)] == [
        list(plan.layers(g)) for g in range(8)]
    assert plan.reads(99).group_count == 8 and plan.reads(0).group_count == 1  # clamped
    small_first = plan.read_in((0, 1, 3, 8))  # ``experiments.streaming.rules.read_groups``'s uneven cuts: a small group 0
    assert small_first.group_count == 3
    assert small_first.groups == [[0, 8], [1, 2, 9, 10], [3, 4, 5, 6, 7, 11, 12, 13, 14, 15]]
    assert [list(small_first.layers(r)) for r in range(3)] == [[0], [1, 2], [3, 4, 5, 6, 7]]
    assert plan.read_in([0, 8]).group_count == 1
    for bad in ((0, 3), (1, 8), (0, 4, 4, 8), (0, 5, 3, 8), (8,), (0, 9)):
        with pytest.raises(ValueError, match="read cuts must rise from 0 to 8"):
            plan.read_in(bad)


@pytest.mark.parametrize(("kind", "layout"), STREAMABLE)
def test_a_read_in_merged_groups_hands_over_their_layers_verified(tmp_path, kind, layout) -> None:
    """Two read groups over the pool's four layer groups, even and uneven: each hands over its layers' bytes,
    exactly; every stored part was still verified (``parts_read``), and a read plan of another pool is refused."""
    with stored_pages(tmp_path, kind, layout, seed=6) as st:
        pool, shard, plan, keys, src, dst, ranges = st.pool, st.backend.kv, st.plan, st.keys, st.src, st.dst, st.ranges
        assert plan.group_count == 4
        assert st.backend.batch_set_v1(keys, slots(src)) == [True] * 6
        want = [b"".join(group_bytes(pool, kind, plan, p * PS, g, r) for r in range(ranges) for g in range(4))
                for p in src]
        for reads, landed in ((plan.reads(2), [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]),
                              (plan.read_in((0, 1, 4)), [(0, [0, 1]), (1, [2, 3, 4, 5, 6, 7])])):  # uneven
            zero(pool)
            seen: list[tuple[int, list[int]]] = []
            before = shard.store.own.counters.parts_read
            assert read_layer_groups(shard, parse_keys(keys), slots(dst), lambda g, layers, ok, seen=seen: seen.append(
                (g, list(layers))), reads) == [True] * 6
            assert seen == landed
            got = [b"".join(group_bytes(pool, kind, plan, p * PS, g, r) for r in range(ranges) for g in range(4))
                   for p in dst]
            assert got == want
            assert shard.store.own.counters.parts_read - before == 6 * ranges * 4
        other = plan_for(HostPages.of(make_pool(kind, layout, layers=4)))
        assert other is not None
        with pytest.raises(ValueError, match="not of this pool"):
            read_layer_groups(shard, parse_keys(keys), slots(dst), lambda *a: None, other.reads(2))


@pytest.mark.parametrize(("kind", "layout"), UNSTREAMABLE)
def test_other_layouts_keep_one_part_and_say_so_once(tmp_path, caplog, kind, layout) -> None:
    caplog.set_level(logging.INFO, logger="sgl_kvtier.sglang.parts_plan")
    for i in range(2):
        pool = make_pool(kind, layout)
        fill_random(pool, seed=6)
        (tmp_path / str(i)).mkdir()
        backend = make_backend(tmp_path / str(i), pool, mla=kind == "mla")
        try:
            assert backend.kv.namespace.parts == () and backend.kv.pages.plan is None
            keys = chain_keys(4)
            assert backend.batch_set_v1(keys, slots([1, 2, 3, 4])) == [True] * 4
            expected = [page_bytes(pool, p * PS) for p in (1, 2, 3, 4)]
            zero(pool)
            assert backend.batch_get_v1(keys, slots([5, 6, 7, 8])) == [True] * 4
            assert [page_bytes(pool, p * PS) for p in (5, 6, 7, 8)] == expected
            with pytest.raises(KVTierError, match="does not stream"):
                read_layer_groups(backend.kv, parse_keys(keys), slots([5, 6, 7, 8]), lambda *a: None)
        finally:
            backend.close()
    said = [r for r in caplog.records if "does not stream in layer groups" in r.getMessage()
            and (("mla:" if kind == "mla" else "") + layout + " ") in r.getMessage()]
    assert len(said) <= 1  # once per process and layout (an earlier test may have said it already)


def test_forced_group_count_and_side_pools_keep_one_part(tmp_path) -> None:
    pages = HostPages.of(make_pool("mha", "layer_first", layers=6))
    plan = plan_for(pages, groups=3)
    assert plan is not None and plan.parts == (pages.page_bytes // 6,) * 6 and plan.groups == [[0, 3], [1, 4], [2, 5]]
    assert [plan.group_of(layer) for layer in range(6)] == [0, 0, 1, 1, 2, 2]
    from pools import storage_config

    from sgl_kvtier.sglang.settings import namespace_for

    cfg = storage_config({"devices": [str(tmp_path)], "model_fingerprint": "w"})
    assert namespace_for(cfg, pages).parts == pages.plan.parts
    assert namespace_for(cfg, pages, "draft_kv").parts == ()  # only the KV pool's pages are cut


@pytest.mark.parametrize(("kind", "layout"), STREAMABLE)
def test_parts_name_another_namespace_than_one_part(tmp_path, kind, layout) -> None:
    """The parts are in the KV pool's namespace identity: a store written with one part per page (an older
    build) is another shard, never read against other checksums."""
    from pools import storage_config

    from sgl_kvtier.keys import Namespace
    from sgl_kvtier.sglang.settings import namespace_for

    pages = HostPages.of(make_pool(kind, layout))
    cfg = storage_config({"devices": [str(tmp_path)], "model_fingerprint": "w"}, mla=kind == "mla")
    ns = namespace_for(cfg, pages)
    one = Namespace.from_mapping({k: v for k, v in ns.to_mapping().items() if k != "parts"})
    assert ns.parts == pages.plan.parts and one.parts == ()
    assert ns.digest() != one.digest()
