"""A cluster-mode reader under NFS-like incoherence (``io.stale``): journals seen lagging (a prefix, or zeros
where the bytes are not there yet), new writer directories and journals hidden by a negative lookup cache,
a slot read returning its bytes from before the writer's last rewrite, a lease read returning the previous
lease. Under each: never wrong bytes (every hit is checked against what was put), a stale read is a miss,
and once the fault clears every page the writer holds becomes visible. Clocks are injected; no sleeps.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from support import key, namespace
from test_announced import PAGE, Pages, beat, cluster_config, peer_of

from sgl_kvtier.errors import DeviceError
from sgl_kvtier.io.engine import ThreadPoolEngine
from sgl_kvtier.io.file_view import POSIX
from sgl_kvtier.io.stale import StaleFiles, StaleSlotEngine
from sgl_kvtier.keys import PageKey
from sgl_kvtier.sharing.follower import SUSPECT_TRIES, PageReader, reading_through
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import journal as jr


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def boundaries(meta: Path) -> dict[int, set[int]]:
    """Per journal generation of ``meta``, every offset a cursor may stop at (the ends of whole records)."""
    out = {}
    for gen in jr.journal_generations(meta):
        data = jr.journal_path(meta, gen).read_bytes()
        start = fmt.JOURNAL_FILE_HEADER_BYTES
        out[gen] = {0, start, *(end for end, _ in fmt.iter_records(data, start))}
    return out


def writer(path: Path, host: str) -> SharedPool:
    return SharedPool.open_writer(cluster_config(path, host), namespace(PAGE))


def own_keys(pool: SharedPool) -> set[PageKey]:
    assert pool.own is not None
    return set(pool.own.keys())


def settle(a: SharedPool, b: SharedPool, beats: int = 1) -> None:
    for _ in range(beats):
        beat(a)
        b.refresh(force=True)


# ---------------------------------------------------------------------- (a) journal lag
@pytest.mark.parametrize("zero_share", [0.0, 1.0], ids=["prefix", "zeros"])
def test_journal_lag_never_gives_wrong_bytes_and_every_page_shows_once_it_clears(tmp_path, zero_share):
    pages, rng = Pages(), random.Random(7)
    view = StaleFiles(POSIX, seed=3, lag_rate=0.7, zero_share=zero_share)
    with writer(tmp_path, "ha") as a, reading_through(view), writer(tmp_path, "hb") as b:
        assert a.own is not None
        meta, put, n, seen = a.own.layout.meta, [], 0, set()
        for round_ in range(40):
            fresh = list(range(n, n + rng.randint(1, 3)))
            n += len(fresh)
            pages.put(a, fresh)
            put += fresh
            if round_ % 5 == 4:
                a.delete([key(rng.choice(put))])
            if round_ % 13 == 12:
                a.checkpoint()
            beat(a)
            b.refresh(force=True)
            seen.update(pages.hits(b, put))  # every hit right (checked inside)
            gen, offset = peer_of(b, a).recovery.cursor
            assert offset in boundaries(meta).get(gen, {0, offset})  # never inside a record
            assert set(peer_of(b, a).keys()) <= set(map(key, put))
        assert view.injected["zeros" if zero_share else "lag"] > 0 and len(seen) > len(put) // 2  # lag, not blindness
        view.clear()
        b.refresh(force=True)
        assert set(peer_of(b, a).keys()) == own_keys(a)
        assert sorted(pages.hits(b, put)) == sorted(int.from_bytes(k[:4], "little") for k in own_keys(a))


# ---------------------------------------------------------------------- (b) negative lookup
def test_a_new_writer_directory_hidden_by_a_negative_lookup_shows_up_later(tmp_path):
    pages, clock = Pages(), Clock()
    view = StaleFiles(POSIX, clock=clock, hide_s=30.0, hide_match=("w-*",))
    with reading_through(view), writer(tmp_path, "hb") as b:
        with writer(tmp_path, "ha") as a:
            pages.put(a, [1, 2])
            beat(a)
            b.refresh(force=True)
            assert a.wid not in b.peers() and pages.hits(b, [1, 2]) == []  # a pool does not see it yet
            assert a.wid is not None and view.injected["hidden"] > 0
            config = cluster_config(tmp_path, "hc")
            with pytest.raises(DeviceError, match="not there"):
                PageReader.open(config, a.namespace, wid=a.wid)
            clock.t += 31.0
            with PageReader.open(config, a.namespace, wid=a.wid) as reader:
                assert pages.hits(reader, [1, 2]) == [1, 2]


def test_a_new_journal_hidden_by_a_negative_lookup_delays_only_its_records(tmp_path):
    pages, clock = Pages(), Clock()
    view = StaleFiles(POSIX, clock=clock, hide_s=30.0, hide_match=("journal-*.log",))
    with writer(tmp_path, "ha") as a, reading_through(view), writer(tmp_path, "hb") as b:
        pages.put(a, [1, 2])
        beat(a)
        b.refresh(force=True)
        assert pages.hits(b, [1, 2]) == []  # a's journal: first looked up just now, hidden for 30 s
        clock.t += 31.0
        b.refresh(force=True)
        assert pages.hits(b, [1, 2]) == [1, 2]
        a.checkpoint()  # the journal b follows is deleted; the next one is new to b
        pages.put(a, [3])
        beat(a)
        b.refresh(force=True)
        assert pages.hits(b, [1, 2, 3]) == [1, 2]  # the checkpoint's pages, not the hidden journal's
        clock.t += 31.0
        b.refresh(force=True)
        assert pages.hits(b, [1, 2, 3]) == [1, 2, 3]


# ---------------------------------------------------------------------- (c) stale slot
def _slot_file(pool: SharedPool, slot: int) -> tuple[str, int]:
    """The segment file and offset of ``pool``'s own ``slot`` (one device)."""
    assert pool.own is not None
    fd, offset = pool.own.layout.arenas[0].locate(slot)
    return os.readlink(f"/proc/self/fd/{fd}"), offset


def test_a_stale_slot_read_is_a_miss_and_the_page_comes_back_once_the_cache_clears(tmp_path):
    pages = Pages()
    with writer(tmp_path, "ha") as a:
        pages.put(a, [1, 2])
        beat(a)
        assert a.wid is not None and a.own is not None
        engine = StaleSlotEngine(ThreadPoolEngine(2))
        with PageReader.open(cluster_config(tmp_path, "hb"), a.namespace, wid=a.wid, engine=engine,
                             follows_peer=True) as reader:
            assert pages.hits(reader, [1, 2]) == [1, 2]
            slot = a.slot_of(key(1))
            assert slot is not None
            a.delete([key(1)])
            engine.capture(*_slot_file(a, slot), PAGE)  # what a client cache holds of the slot: page 1
            pages.put(a, [3])
            assert a.slot_of(key(3)) == slot  # page 3 rewrote page 1's slot
            beat(a)
            reader.refresh()
            assert pages.hits(reader, [1, 2, 3]) == [2]  # page 1's old bytes never pass for page 3
            # A data cache, not a descriptor: the read again through a fresh descriptor is stale too.
            assert engine.served == 2 and reader.counters.segments_reopened == 1
            assert reader.counters.fresh_rereads == 0 and not reader.contains(key(3))  # a miss, the page set aside
            for _ in range(SUSPECT_TRIES - 2):  # while the cache stays stale: misses, never wrong bytes
                beat(a)
                reader.refresh()
                beat(a)
                reader.refresh()
                assert pages.hits(reader, [3]) == []
            engine.forget()  # the cache clears
            for _ in range(1 << SUSPECT_TRIES):
                beat(a)
                reader.refresh()
            assert pages.hits(reader, [1, 2, 3]) == [2, 3]


def test_a_suspect_named_again_by_the_journal_is_the_journals(tmp_path):
    """A page set aside after a stale read, then deleted by its writer, never comes back."""
    pages = Pages()
    with writer(tmp_path, "ha") as a:
        pages.put(a, [1])
        beat(a)
        assert a.wid is not None
        engine = StaleSlotEngine(ThreadPoolEngine(2))
        with PageReader.open(cluster_config(tmp_path, "hb"), a.namespace, wid=a.wid, engine=engine,
                             follows_peer=True) as reader:
            slot = a.slot_of(key(1))
            assert slot is not None
            engine.remember(*_slot_file(a, slot), b"\0" * PAGE)
            assert pages.hits(reader, [1]) == [] and not reader.contains(key(1))
            engine.forget()
            a.delete([key(1)])
            for _ in range(4):
                beat(a)
                reader.refresh()
            assert not reader.contains(key(1)) and pages.hits(reader, [1]) == []


# ---------------------------------------------------------------------- (d) stale lease
def test_a_stale_lease_delays_a_page_by_one_beat(tmp_path):
    pages = Pages()
    view = StaleFiles(POSIX, stale_rate=1.0)  # every lease read: the lease before the last one seen
    with writer(tmp_path, "ha") as a, reading_through(view), writer(tmp_path, "hb") as b:
        pages.put(a, [1])
        beat(a)
        b.refresh(force=True)
        assert pages.hits(b, [1]) == []  # the lease seen is the one before this beat
        pages.put(a, [2])
        beat(a)
        b.refresh(force=True)
        assert pages.hits(b, [1, 2]) == [1]
        beat(a)
        b.refresh(force=True)
        assert pages.hits(b, [1, 2]) == [1, 2]
        assert view.injected["stale"] > 0
        view.clear()
        b.refresh(force=True)
        assert pages.hits(b, [1, 2]) == [1, 2]


# ---------------------------------------------------------------------- all at once
def test_every_fault_at_once_over_random_rounds(tmp_path):
    pages, clock, rng = Pages(), Clock(), random.Random(11)
    view = StaleFiles(POSIX, seed=5, clock=clock, lag_rate=0.3, hide_s=3.0, hide_match=("journal-*.log",),
                      stale_rate=0.3)
    with writer(tmp_path, "ha") as a, reading_through(view), writer(tmp_path, "hb") as b:
        put: list[int] = []
        seen: set[int] = set()
        for n in range(0, 150, 3):
            pages.put(a, [n, n + 1, n + 2])
            put += [n, n + 1, n + 2]
            if rng.random() < 0.3:
                a.delete([key(rng.choice(put))])
            if rng.random() < 0.08:
                a.checkpoint()
            if rng.random() < 0.8:
                beat(a)
            clock.t += 1.0
            b.refresh(force=True)
            seen.update(pages.hits(b, rng.sample(put, min(len(put), 12))))
        assert all(view.injected[k] > 0 for k in ("lag", "zeros", "hidden", "stale")) and len(seen) > 20
        view.clear()
        settle(a, b, beats=2)
        assert set(peer_of(b, a).keys()) == own_keys(a)
        expected = sorted(int.from_bytes(k[:4], "little") for k in own_keys(a))
        assert sorted(pages.hits(b, put)) == expected

