"""``TailStream`` (``experiments.streaming.tail_stream``) on SGLang's real host pool and a real store on a tmp dir: a
bound hit's pages land group-major into its host slots, group by group, verified; a corrupt part, a read
error or a raising store fails exactly what did not land; ``cancel`` stops the IO; pages read-ahead staged
are copied whole, not read again (READY at once, READING when their read ends, FAILED read from the store)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("sglang")

from pools import fill_random, mha_host_pool, page_bytes, zero  # noqa: E402
from test_storage_adapter import PS, chain_keys, make_backend, slots  # noqa: E402

from sgl_kvtier.experiments.streaming.backend_side import require_side
from sgl_kvtier.experiments.streaming.contract import GroupVerdict  # noqa: E402
from sgl_kvtier.keys import parse_keys  # noqa: E402

N = 6
SRC = [3, 9, 4, 11, 6, 13]
DST = [20, 25, 21, 30, 22, 31]
BOUND_S = 30.0  # bounds a failure (a hang), never a synchroniser


class Hold:
    """An observer that holds the stream's thread after group ``group`` was recorded, until ``release``."""

    def __init__(self, group: int = 0):
        self.group = group
        self.reached = threading.Event()
        self._go = threading.Event()
        self.seen: list[int] = []

    def __call__(self, stream, group: int) -> None:
        self.seen.append(group)
        if group == self.group:
            self.reached.set()
            assert self._go.wait(BOUND_S), "the test never released the held group"

    def release(self) -> None:
        self._go.set()

    @classmethod
    def on(cls, backend, group: int = 0) -> Hold:
        """A hold at ``group`` installed as ``backend``'s binder observer."""
        hold = require_side(backend).binder.observer = cls(group)
        return hold


def streamed(tmp_path, pool=None, **extra):
    """A backend with streaming on (unless ``extra`` says otherwise) over a kvheavy-shaped pool (8 layers: 4 groups of 2), ``N`` pages
    written from ``SRC``; the pool zeroed after. Returns (backend, pool, keys, the pages' bytes)."""
    pool = pool or mha_host_pool("layer_first", layers=8, heads=4, head_dim=64, tokens=256)
    fill_random(pool, seed=11)
    extra.setdefault("readahead_bytes", 0)
    extra.setdefault("streaming", "on")
    backend = make_backend(tmp_path, pool, **extra)
    keys = chain_keys(N)
    want = [page_bytes(pool, p * PS) for p in SRC]
    assert backend.batch_set_v1(keys, slots(SRC)) == [True] * N
    zero(pool)
    return backend, pool, keys, want


def dst_bytes(pool, pages=DST) -> list[bytes]:
    return [page_bytes(pool, p * PS) for p in pages]


def group_slice(plan, group: int, rng: int) -> slice:
    offset, length = plan.part_range(rng * plan.group_count + group)
    return slice(offset, offset + length)


def flip(backend, key: str, at: int) -> None:
    """Flip one byte at offset ``at`` of ``key``'s stored page, in its segment file."""
    store = backend.kv.store.own
    slot = store.slot_of(parse_keys([key])[0])
    arena = store.layout.arenas[slot % len(store.layout.arenas)]
    seg, index = divmod(slot // len(store.layout.arenas), arena.slots_per_segment)
    with open(arena.dir / f"seg-{seg:05d}.dat", "r+b") as f:
        f.seek(index * store.slot_bytes + at)
        byte = f.read(1)[0]
        f.seek(index * store.slot_bytes + at)
        f.write(bytes([byte ^ 0x5A]))


def parts_read(backend) -> int:
    return backend.kv.store.own.counters.parts_read


def staged_done(backend) -> None:
    """Wait for every staged read to end (their entries' own events)."""
    for entry in list(backend.kv.readahead._entries.values()):
        assert entry.done.wait(BOUND_S)


def test_groups_land_in_order_and_group_0_lands_before_the_rest(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path)
    try:
        plan = backend.kv.pages.plan
        assert plan.group_count == 4
        hold = Hold.on(backend)
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream is not None and stream.pages == N and stream.groups == 4
        assert hold.reached.wait(BOUND_S)
        assert stream.wait_group(0, 0, timeout=0) is GroupVerdict.LANDED
        assert stream.wait_group(1, 0, timeout=0) is GroupVerdict.TIMEOUT  # in flight, not recorded
        assert stream.landed_pages() == 0 and not stream.ended
        rate = stream.read_rate()
        assert rate is not None and rate > 0
        per_group = plan.page_bytes // 4
        assert stream.remaining_bytes(0) == N * 3 * per_group and stream.remaining_bytes(4) == 2 * 3 * per_group
        for got, exp in zip(dst_bytes(pool), want):  # group 0 is in the slots, groups 2.. are not read yet
            for rng in (0, 1):
                assert got[group_slice(plan, 0, rng)] == exp[group_slice(plan, 0, rng)]
                for later in (2, 3):
                    assert got[group_slice(plan, later, rng)] == bytes(per_group // 2)
        hold.release()
        assert stream.wait_ended(BOUND_S)
        assert hold.seen == [0, 1, 2, 3]
        assert [stream.wait_group(g, 0, timeout=0) for g in range(4)] == [GroupVerdict.LANDED] * 4
        assert stream.landed_pages() == N and stream.remaining_bytes(0) == 0
        assert dst_bytes(pool) == want
        assert [list(stream.layers(g)) for g in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        counts = require_side(backend).binder.counts()
        assert counts.streams_bound == 1 and counts.streamed_pages == N and counts.failed_groups == 0
        assert backend.telemetry().boundary.total == 0
    finally:
        backend.close()


def test_a_stream_in_two_uneven_read_groups_lands_their_layer_groups_together(tmp_path) -> None:
    """``cuts=(0, 1, 4)`` over the pool's 4 layer groups (``experiments.streaming.rules.read_groups``'s small group 0): read group 0
    is layers 0-1 (layer group 0), read group 1 layers 2-7 (layer groups 1-3, each still verified by its own
    checksums); the binder counts the read groups."""
    backend, pool, keys, want = streamed(tmp_path)
    try:
        plan = backend.kv.pages.plan
        hold = Hold.on(backend)
        before = parts_read(backend)
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST), cuts=(0, 1, 4))
        assert stream is not None and stream.groups == 2
        assert [list(stream.layers(g)) for g in range(2)] == [[0, 1], [2, 3, 4, 5, 6, 7]]
        assert hold.reached.wait(BOUND_S)
        assert stream.wait_group(0, 0, timeout=0) is GroupVerdict.LANDED
        assert stream.wait_group(1, 0, timeout=0) is GroupVerdict.TIMEOUT  # in flight, not recorded
        per_group = plan.page_bytes // 4
        assert stream.remaining_bytes(0) == N * 3 * per_group
        for got, exp in zip(dst_bytes(pool), want):  # layer group 0 is in the slots, verified
            for rng in (0, 1):
                assert got[group_slice(plan, 0, rng)] == exp[group_slice(plan, 0, rng)]
        hold.release()
        assert stream.wait_ended(BOUND_S) and hold.seen == [0, 1]
        assert dst_bytes(pool) == want and stream.landed_pages() == N
        assert parts_read(backend) - before == N * 8  # 4 layer groups x K, V: every part verified
        assert require_side(backend).binder.counts().read_groups == 2 and require_side(backend).binder.counts().streams_bound == 1
    finally:
        backend.close()


def test_the_read_rate_leaves_the_first_landing_s_set_up_out_once_a_second_landed_and_is_settled_then(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path)
    try:
        per_group = N * backend.kv.pages.plan.page_bytes // 4
        holds = [Hold(group=0), Hold(group=1)]
        require_side(backend).binder.observer = lambda stream, group: [h(stream, group) for h in holds]
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream is not None and holds[0].reached.wait(BOUND_S)
        began, first = stream._began, stream._first_at
        stream._clock = lambda: began + 4.0  # one landing: counted from the thread's start
        assert stream.read_rate() == pytest.approx(per_group / 4.0) and not stream.rate_settled()
        stream._clock = lambda: first + 2.0
        holds[0].release()
        assert holds[1].reached.wait(BOUND_S)  # group 1 landed: counted from the first landing, its bytes only
        assert stream.read_rate() == pytest.approx(per_group / 2.0) and stream.rate_settled()
        stream._clock = lambda: first + 8.0  # nothing more landed: the rate falls
        assert stream.read_rate() == pytest.approx(per_group / 8.0)
        holds[1].release()
        assert stream.wait_ended(BOUND_S) and dst_bytes(pool) == want
    finally:
        for h in holds:
            h.release()
        backend.close()

def test_a_corrupt_part_fails_that_pages_group_on_and_nothing_else(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path)
    try:
        plan = backend.kv.pages.plan
        flip(backend, keys[2], group_slice(plan, 2, 1).start + 17)  # page 2, group 2's V range
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream.wait_ended(BOUND_S)
        assert stream.wait_group(0, 0, None) is GroupVerdict.LANDED and stream.wait_group(1, 0, None) is GroupVerdict.LANDED
        assert stream.wait_group(2, 0, None) is GroupVerdict.FAILED and stream.wait_group(3, 2, None) is GroupVerdict.FAILED
        assert stream.wait_group(3, 3, None) is GroupVerdict.LANDED  # the pages after it landed whole
        assert stream.landed_pages() == 2
        got = dst_bytes(pool)
        assert got[:2] == want[:2] and got[3:] == want[3:]
        counts = require_side(backend).binder.counts()
        assert counts.failed_pages == 1 and counts.failed_groups == 2 and counts.streamed_pages == N - 1
        assert require_side(backend).binder.answer(parse_keys(keys), slots(DST)) == [True, True] + [False] * 4
        assert backend.kv.store.counters.corrupt_pages == 1  # dropped by the store, as get drops it
    finally:
        backend.close()


def test_a_page_failing_a_group_settles_only_after_the_group_sent_beside_it_landed(tmp_path) -> None:
    """The store sends read group g + 1 before g's verdicts (``part_reads``): a page failing in group 1 may
    still be written by group 2's IO, so its slots are not settled (SGLang may not get them back,
    ``binding.claim_released``) until group 2 landed; pages that land stay unsettled until their last group."""
    backend, pool, keys, want = streamed(tmp_path)
    try:
        plan = backend.kv.pages.plan
        flip(backend, keys[2], group_slice(plan, 1, 0).start + 5)  # page 2, group 1's K range
        seen: list[tuple[int, bool, bool]] = []
        require_side(backend).binder.observer = lambda stream, group: seen.append(
            (group, stream.page_settled(2), stream.page_settled(3)))
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream.wait_ended(BOUND_S) and stream.groups == 4
        assert seen == [(0, False, False), (1, False, False), (2, True, False), (3, True, True)]
        assert stream.wait_group(1, 2, None) is GroupVerdict.FAILED
        assert stream.wait_group(0, 2, None) is GroupVerdict.LANDED
        assert dst_bytes(pool)[3:] == want[3:]
    finally:
        backend.close()


def test_read_errors_fail_every_group_and_answer_nothing(tmp_path) -> None:
    backend, pool, keys, _ = streamed(tmp_path, fault_injection={"read_error_rate": 1.0, "seed": 1})
    try:
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream.wait_ended(BOUND_S)
        assert [stream.wait_group(g, 0, None) for g in range(4)] == [GroupVerdict.FAILED] * 4
        assert stream.landed_pages() == 0 and stream.remaining_bytes(0) == 0
        assert backend.batch_get_v1(keys, slots(DST)) == [False] * N
        assert require_side(backend).binder.counts().failed_pages == N
    finally:
        backend.close()


def test_a_raising_store_fails_the_stream_and_is_counted_once(tmp_path, monkeypatch) -> None:
    backend, pool, keys, _ = streamed(tmp_path)
    try:
        def broken(*args, **kwargs):
            raise OSError(5, "the device went away")

        monkeypatch.setattr(backend.kv.store, "get_parts", broken)
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream.wait_ended(BOUND_S)
        assert stream.wait_group(0, 0, timeout=0) is GroupVerdict.FAILED and stream.read_rate() is None
        assert backend.telemetry().boundary.expected == 1 and require_side(backend).binder.counts().stream_errors == 1
    finally:
        backend.close()


def test_cancel_stops_the_io_after_what_was_in_flight(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path)
    try:
        plan = backend.kv.pages.plan
        hold = Hold.on(backend)
        before = parts_read(backend)
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert hold.reached.wait(BOUND_S)
        stream.cancel()
        assert stream.wait_group(1, 0, timeout=0) is GroupVerdict.FAILED  # at once, while IO is in flight
        assert stream.wait_group(0, 0, timeout=0) is GroupVerdict.LANDED  # landed before the cancel
        hold.release()
        assert stream.wait_ended(BOUND_S) and stream.cancelled
        assert hold.seen == [0]
        assert parts_read(backend) - before == N * 2 * 2  # groups 0 and 1 (in flight at the cancel), no more
        for got in dst_bytes(pool):
            for rng in (0, 1):
                for later in (2, 3):
                    assert got[group_slice(plan, later, rng)] == bytes(plan.page_bytes // 8)
        assert stream.landed_pages() == 0 and require_side(backend).binder.counts().cancelled_streams == 1
        stream.cancel()  # idempotent
    finally:
        backend.close()


def test_staged_ready_pages_are_copied_not_read_again(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path, readahead_bytes=64 << 20)
    try:
        assert backend.batch_exists(keys[:3]) == 3  # read-ahead stages the first three pages
        staged_done(backend)
        before = parts_read(backend)
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream.wait_ended(BOUND_S)
        assert dst_bytes(pool) == want and stream.landed_pages() == N
        assert parts_read(backend) - before == (N - 3) * 8  # only the unstaged pages were read group-major
        ra = backend.kv.readahead
        assert ra.counters.served == 3 and ra.counters.joined == 0 and ra.buffers_in_use() == 0
        assert require_side(backend).binder.counts().staged_pages == 3
    finally:
        backend.close()


def hold_staged_reads(ra) -> tuple[threading.Event, threading.Event]:
    """Hold read-ahead's staged reads: ``entered`` is set once one is in flight, each waits for ``gate``."""
    gate, entered = threading.Event(), threading.Event()
    reader = ra._reader

    def gated(keys_, pages_):
        entered.set()
        assert gate.wait(BOUND_S)
        return reader(keys_, pages_)

    ra._reader = gated
    return gate, entered


def test_staged_reading_pages_land_when_their_read_ends(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path, readahead_bytes=64 << 20)
    try:
        ra = backend.kv.readahead
        gate, entered = hold_staged_reads(ra)
        assert backend.batch_exists(keys) == N
        assert entered.wait(BOUND_S)  # the staged read is in flight, held
        before = parts_read(backend)
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream.wait_group(0, 0, timeout=0) is GroupVerdict.TIMEOUT  # nothing landed under a held read
        gate.set()
        assert stream.wait_ended(BOUND_S) and dst_bytes(pool) == want
        assert parts_read(backend) == before and ra.counters.served == N and ra.counters.joined == N
        assert ra.buffers_in_use() == 0
    finally:
        gate.set()
        backend.close()


def test_a_failed_staged_read_is_read_from_the_store(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path, readahead_bytes=64 << 20)
    try:
        ra = backend.kv.readahead
        reader, lost = ra._reader, parse_keys([keys[1]])[0]

        def losing(keys_, pages_):  # the staged read of page 1 fails; the others are real reads
            out = reader(keys_, pages_)
            return [ok and k != lost for k, ok in zip(keys_, out)]

        ra._reader = losing
        assert backend.batch_exists(keys) == N
        staged_done(backend)
        before = parts_read(backend)
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream.wait_ended(BOUND_S) and dst_bytes(pool) == want and stream.landed_pages() == N
        assert parts_read(backend) - before == 8  # page 1 alone, group-major from the store
        assert ra.counters.served == N - 1 and ra.buffers_in_use() == 0
    finally:
        backend.close()


def test_a_cancelled_stream_gives_its_staged_pages_back(tmp_path) -> None:
    backend, pool, keys, _ = streamed(tmp_path, readahead_bytes=64 << 20)
    try:
        ra = backend.kv.readahead
        gate, entered = hold_staged_reads(ra)
        assert backend.batch_exists(keys) == N and entered.wait(BOUND_S)
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream.wait_group(0, 0, timeout=0) is GroupVerdict.TIMEOUT
        stream.cancel()
        assert stream.wait_ended(BOUND_S)  # ends while the staged read is still held: it writes only staging
        assert dst_bytes(pool) == [bytes(len(b)) for b in dst_bytes(pool)]
        gate.set()
        ra.close()  # waits for the staged reads: every buffer freed by its job
        assert ra.buffers_in_use() == 0
    finally:
        gate.set()
        backend.close()


def test_a_stream_queued_behind_others_is_correct_and_cancels_at_once(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path)
    try:
        go, held = threading.Event(), threading.Semaphore(0)

        def hold_all(stream, group: int) -> None:  # every running stream waits after its group 0
            if group == 0:
                held.release()
                assert go.wait(BOUND_S)

        require_side(backend).binder.observer = hold_all
        sets = [DST, [0, 1, 2, 5, 7, 8], [10, 12, 14, 15, 16, 17], [18, 19, 23, 24, 26, 27]]
        running = [require_side(backend).binder.bind(parse_keys(keys), slots(s)) for s in sets[:2]]
        assert held.acquire(timeout=BOUND_S) and held.acquire(timeout=BOUND_S)  # both executor threads held
        queued = [require_side(backend).binder.bind(parse_keys(keys), slots(s)) for s in sets[2:]]
        assert all(q.wait_group(0, 0, timeout=0) is GroupVerdict.TIMEOUT for q in queued)
        queued[0].cancel()
        assert queued[0].ended and queued[0].wait_group(0, 0, timeout=0) is GroupVerdict.FAILED  # never ran
        go.set()
        for stream in running + queued:
            assert stream.wait_ended(BOUND_S)
        assert [dst_bytes(pool, s) == want for s in sets] == [True, True, False, True]
        assert dst_bytes(pool, sets[2]) == [bytes(len(b)) for b in want]  # the cancelled one wrote nothing
        assert require_side(backend).binder.live_streams() == 0
    finally:
        go.set()
        backend.close()
