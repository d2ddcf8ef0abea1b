"""A follower whose segment descriptors were opened before its writer rewrote slots in place (JuiceFS over FUSE
across hosts: such a descriptor keeps returning the old bytes; a fresh open sees the new ones), emulated by
``io.stale.StaleDescriptorEngine``. The follower reads a failing page again through a fresh descriptor of
its segment (``store.renewal``): served when it verifies, at most one reopen per segment per follow
interval, never unverified bytes. Clocks are injected; no sleeps.
"""

from __future__ import annotations

import os
from pathlib import Path

from support import key
from test_announced import Pages, beat, cluster_config
from test_stale_view import Clock, _slot_file, writer

from sgl_kvtier.io.engine import ThreadPoolEngine
from sgl_kvtier.io.stale import StaleDescriptorEngine
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.sharing.pool import SharedPool

INTERVAL = 5.0


def follower(tmp_path: Path, a: SharedPool, engine: StaleDescriptorEngine, clock: Clock) -> PageReader:
    assert a.wid is not None
    return PageReader.open(cluster_config(tmp_path, "hb", follow_interval_s=INTERVAL), a.namespace, wid=a.wid,
                           engine=engine, follows_peer=True, clock=clock)


def rewrite(a: SharedPool, pages: Pages, old: int, new: int) -> int:
    """Writer ``a`` drops page ``old`` and puts ``new`` in its slot (in place); the slot."""
    slot = a.slot_of(key(old))
    assert slot is not None
    a.delete([key(old)])
    pages.put(a, [new])
    assert a.slot_of(key(new)) == slot
    beat(a)
    return slot


def test_a_page_rewritten_under_an_old_descriptor_is_read_again_through_a_fresh_one(tmp_path):
    pages, clock = Pages(), Clock()
    with writer(tmp_path, "ha") as a:
        pages.put(a, [1, 2])
        beat(a)
        engine = StaleDescriptorEngine(ThreadPoolEngine(2))
        with follower(tmp_path, a, engine, clock) as reader:
            assert pages.hits(reader, [1, 2]) == [1, 2]
            segment, _ = _slot_file(a, a.slot_of(key(1)) or 0)
            assert engine.hold(segment) == 1  # the follower's descriptor: the segment as it is now
            rewrite(a, pages, 1, 3)
            reader.refresh()
            assert pages.hits(reader, [3]) == [3]  # the old bytes failed; the fresh descriptor served page 3
            assert engine.served == 1 and reader.counters.fresh_rereads == 1
            assert reader.counters.segments_reopened == 1 and reader.counters.corrupt_pages == 0
            assert pages.hits(reader, [2, 3]) == [2, 3] and engine.served == 1  # the fresh one stays

            # Within the interval the segment is not reopened again: a page rewritten now is a miss (kept
            # as a suspect), then served once the interval passed and the suspect is tried again.
            assert engine.hold(segment) == 1
            rewrite(a, pages, 2, 4)
            reader.refresh()
            assert pages.hits(reader, [4]) == [] and reader.counters.segments_reopened == 1
            assert not reader.contains(key(4))
            clock.t += INTERVAL
            beat(a)
            reader.refresh()  # the suspect is due after one beat of its writer
            assert pages.hits(reader, [3, 4]) == [3, 4]
            assert reader.counters.segments_reopened == 2 and reader.counters.fresh_rereads == 2


def test_group_major_reads_are_read_again_through_a_fresh_descriptor(tmp_path):
    pages, clock = Pages(), Clock()
    with writer(tmp_path, "ha") as a:
        pages.put(a, [1, 2])
        beat(a)
        engine = StaleDescriptorEngine(ThreadPoolEngine(2))
        with follower(tmp_path, a, engine, clock) as reader:
            assert pages.hits(reader, [1]) == [1]
            engine.hold(_slot_file(a, a.slot_of(key(1)) or 0)[0])
            rewrite(a, pages, 1, 3)
            reader.refresh()
            seen: list[tuple[int, list[bool]]] = []
            pages.mem.clear()
            assert reader.get_parts([key(3)], [pages.mem.runs(0)], lambda g, ok: seen.append((g, list(ok)))) == [True]
            assert pages.mem.page(0).tobytes() == pages.expected[3] and seen and all(ok == [True] for _, ok in seen)
            assert reader.counters.segments_reopened == 1 and reader.counters.fresh_rereads >= 1


def test_bytes_that_fail_through_a_fresh_descriptor_too_are_a_miss(tmp_path):
    pages, clock = Pages(), Clock()
    with writer(tmp_path, "ha") as a:
        pages.put(a, [1, 2])
        beat(a)
        engine = StaleDescriptorEngine(ThreadPoolEngine(2))
        with follower(tmp_path, a, engine, clock) as reader:
            assert pages.hits(reader, [1, 2]) == [1, 2]
            path, offset = _slot_file(a, a.slot_of(key(1)) or 0)
            fd = os.open(path, os.O_WRONLY)
            try:  # page 1 damaged on disk, then again: neither the old descriptor nor a fresh one verifies it
                os.pwrite(fd, b"\xa5" * 4096, offset)
                engine.hold(path)
                os.pwrite(fd, b"\x5a" * 4096, offset)
            finally:
                os.close(fd)
            assert pages.hits(reader, [1, 2]) == [2]
            assert reader.counters.segments_reopened == 1 and reader.counters.fresh_rereads == 0
            assert reader.counters.corrupt_pages == 1 and not reader.contains(key(1))


def test_the_writer_and_an_offline_reader_renew_nothing(tmp_path):
    pages = Pages()
    with writer(tmp_path, "ha") as a:
        pages.put(a, [1])
        beat(a)
        assert a.own is not None and a.wid is not None
        engine = StaleDescriptorEngine(ThreadPoolEngine(2))
        config = cluster_config(tmp_path, "hb", follow_interval_s=INTERVAL)
        with PageReader.open(config, a.namespace, wid=a.wid, engine=engine) as offline:
            engine.hold(_slot_file(a, a.slot_of(key(1)) or 0)[0])
            rewrite(a, pages, 1, 2)
            offline.refresh()
            assert pages.hits(offline, [2]) == [] and offline.counters.segments_reopened == 0
        assert a.own._io.renewal is None


def test_a_pool_serves_a_peers_rewritten_pages_through_fresh_descriptors(tmp_path):
    """Through ``SharedPool``: a reader pool's peer renews its descriptors; churn over a small pool."""
    pages = Pages()
    with writer(tmp_path, "ha") as a:
        pages.put(a, [0])
        beat(a)
        engine = StaleDescriptorEngine(ThreadPoolEngine(2))
        config = cluster_config(tmp_path, "hb", capacity_pages=64)
        with SharedPool.open_reader(config, a.namespace, engine=engine) as b:
            assert pages.hits(b, [0]) == [0]
            assert a.own is not None
            segments = {_slot_file(a, s)[0] for s in range(8)}
            for n in range(1, 200):
                if n % 16 == 0:
                    for path in segments:
                        engine.hold(path)  # every descriptor open now goes stale from here
                pages.put(a, [n])  # evicts and reuses slots once the pool is full
                beat(a)
                b.refresh(force=True)
                if n % 8 == 0:
                    assert pages.hits(b, list(range(n - 7, n + 1))) == list(range(n - 7, n + 1))
            held = sorted(int.from_bytes(k[:4], "little") for k in a.own.keys())
            assert len(held) >= 32
            assert pages.hits(b, held) == held  # every page a holds, byte-exact (checked inside)
            assert engine.served > 0 and b.counters.segments_reopened > 0 and b.counters.fresh_rereads > 0
