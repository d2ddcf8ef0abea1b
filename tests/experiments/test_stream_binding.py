"""``StreamBinder`` (``experiments.streaming.binding``) and ``KVTierStorage``'s streamed hits on SGLang's real host
pool and a real store: ``batch_get_v1`` answers bound slots at once (the landed head True, the rest False,
never a wait), ``claim_released`` withholds exactly the slots a stream may still write, ``take`` hands a
stream over, a mismatch cancels the stream and reads as today, and with streaming off (or a layout that does
not stream) nothing is bound and ``batch_get_v1`` is what it was."""

from __future__ import annotations

import logging
import threading

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from pools import mha_host_pool, page_bytes  # noqa: E402
from test_storage_adapter import PS, chain_keys, slots  # noqa: E402
from test_tail_stream import BOUND_S, DST, Hold, N, dst_bytes, flip, group_slice, staged_done, streamed  # noqa: E402

from sgl_kvtier.experiments.streaming.backend_side import require_side
from sgl_kvtier.experiments.streaming.contract import GroupVerdict  # noqa: E402
from sgl_kvtier.keys import parse_keys  # noqa: E402


def answered_in_thread(backend, keys, host_indices) -> list[bool]:
    """``batch_get_v1`` on another thread (as SGLang's IO thread calls it), joined within a bound."""
    out: list[list[bool]] = []
    worker = threading.Thread(target=lambda: out.append(backend.batch_get_v1(keys, host_indices)))
    worker.start()
    worker.join(BOUND_S)
    assert not worker.is_alive(), "batch_get_v1 blocked on a stream"
    return out[0]


def test_a_held_stream_answers_false_at_once_then_its_head(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path)
    try:
        hold = Hold(group=0)
        require_side(backend).binder.observer = hold
        require_side(backend).bind_hit(keys + chain_keys(2, "beyond"), slots(DST))  # the allocation covers the first N pages
        assert hold.reached.wait(BOUND_S) and require_side(backend).binder.bound_pages() == N
        assert answered_in_thread(backend, keys, slots(DST)) == [False] * N
        hold.release()
        stream = require_side(backend).binder.take(slots(DST))  # the plugin's hand-over (then nothing is bound)
        assert stream is not None and require_side(backend).binder.bound_pages() == 0
        assert stream.wait_ended(BOUND_S) and dst_bytes(pool) == want
        assert require_side(backend).binder.answer(parse_keys(keys), slots(DST)) is None  # taken: today's path again
    finally:
        backend.close()


def test_slices_are_answered_in_order_and_a_fully_answered_stream_is_dropped(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path)
    try:
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream.wait_ended(BOUND_S)
        assert backend.batch_get_v1(keys[:4], slots(DST[:4])) == [True] * 4  # SGLang's 128-page batches
        assert require_side(backend).binder.bound_pages() == N
        assert backend.batch_get_v1(keys[4:], slots(DST[4:])) == [True] * 2
        assert require_side(backend).binder.bound_pages() == 0 and require_side(backend).binder.counts().head_pages == N
        released, withheld = require_side(backend).binder.claim_released(slots(DST))
        assert torch.equal(released, slots(DST)) and withheld == []
        assert dst_bytes(pool) == want and backend.telemetry().boundary.total == 0
    finally:
        backend.close()


def test_a_failed_page_is_never_answered_true(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path)
    try:
        flip(backend, keys[3], group_slice(backend.kv.pages.plan, 0, 0).start + 5)
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream.wait_ended(BOUND_S)
        assert backend.batch_get_v1(keys, slots(DST)) == [True] * 3 + [False] * 3
        assert backend.batch_get_v1(keys[3:], slots(DST[3:])) == [False] * 3  # not even the landed pages after it
        assert dst_bytes(pool)[:3] == want[:3]
    finally:
        backend.close()


def test_claim_released_withholds_exactly_the_unfinished_slots(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path, readahead_bytes=64 << 20)
    try:
        flip(backend, keys[3], group_slice(backend.kv.pages.plan, 0, 1).start + 9)  # page 3 fails in group 0
        assert backend.batch_exists(keys[:2]) == 2  # pages 0 and 1 staged: copied whole before the reads
        staged_done(backend)
        hold = Hold(group=0)
        require_side(backend).binder.observer = hold
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert hold.reached.wait(BOUND_S)
        assert stream.wait_group(0, 3, timeout=0) is GroupVerdict.FAILED and stream.landed_pages() == 2
        released, withheld = require_side(backend).binder.claim_released(slots(DST))
        assert torch.equal(released, slots([DST[0], DST[1]]))  # landed: no more writes
        assert len(withheld) == 1 and withheld[0][0] is stream
        # Group 1 is still in flight there, page 3 included: it was sent beside group 0, before page 3 failed
        # (part_reads), so the failed page's slots may still be written until group 1 lands.
        assert torch.equal(withheld[0][1], slots([DST[2], DST[3], DST[4], DST[5]]))
        assert stream.cancelled and require_side(backend).binder.bound_pages() == 0
        hold.release()
        assert stream.wait_ended(BOUND_S) and require_side(backend).binder.live_streams() == 0
        assert dst_bytes(pool)[:2] == want[:2]
        assert require_side(backend).binder.counts().withheld_pages == 4
    finally:
        backend.close()


def test_a_partial_release_keeps_guarding_the_rest(tmp_path) -> None:
    backend, pool, keys, _ = streamed(tmp_path)
    try:
        hold = Hold(group=0)
        require_side(backend).binder.observer = hold
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert hold.reached.wait(BOUND_S)
        released, withheld = require_side(backend).binder.claim_released(slots(DST[4:]))  # SGLang releases the last two
        assert released.numel() == 0 and torch.equal(withheld[0][1], slots(DST[4:]))
        released, withheld = require_side(backend).binder.claim_released(slots(DST[:4]))  # then the rest, still unsettled
        assert released.numel() == 0 and torch.equal(withheld[0][1], slots(DST[:4]))
        hold.release()
        assert stream.wait_ended(BOUND_S)
        released, withheld = require_side(backend).binder.claim_released(slots(DST))  # nothing bound any more
        assert torch.equal(released, slots(DST)) and withheld == []
    finally:
        backend.close()


def test_other_keys_on_bound_slots_cancel_the_stream_and_read_as_today(tmp_path) -> None:
    backend, pool, keys, _ = streamed(tmp_path)
    try:
        others = chain_keys(N, "other")
        assert backend.batch_set_v1(others, slots([0, 1, 2, 5, 7, 8])) == [True] * N
        other_bytes = [page_bytes(pool, p * PS) for p in (0, 1, 2, 5, 7, 8)]
        hold = Hold(group=1)
        require_side(backend).binder.observer = hold
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert hold.reached.wait(BOUND_S)
        done: list[list[bool]] = []
        worker = threading.Thread(target=lambda: done.append(backend.batch_get_v1(others, slots(DST))))
        worker.start()  # cancels the stream, then waits for its end before reading as today
        assert stream.wait_group(3, 0, timeout=BOUND_S) is GroupVerdict.FAILED  # the cancel happened
        hold.release()
        worker.join(BOUND_S)
        assert not worker.is_alive() and done == [[True] * N]
        assert stream.ended and dst_bytes(pool) == other_bytes  # today's read, after the stream's last IO
        assert require_side(backend).binder.counts().mismatches == 1 and require_side(backend).binder.bound_pages() == 0
        assert backend.telemetry().boundary.expected == 1  # a bug path: counted and logged
    finally:
        backend.close()


def test_a_slice_overlapping_a_running_stream_unaligned_cancels_it(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path)
    try:
        hold = Hold(group=0)
        require_side(backend).binder.observer = hold
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert hold.reached.wait(BOUND_S)
        done: list[list[bool]] = []
        unaligned = slots([DST[2], DST[1]])  # bound pages, but not a run of the stream
        worker = threading.Thread(target=lambda: done.append(backend.batch_get_v1(keys[1:3], unaligned)))
        worker.start()
        assert stream.wait_group(3, 0, timeout=BOUND_S) is GroupVerdict.FAILED
        hold.release()
        worker.join(BOUND_S)
        assert not worker.is_alive() and done == [[True, True]] and stream.ended
        assert [page_bytes(pool, DST[2] * PS), page_bytes(pool, DST[1] * PS)] == want[1:3]
        assert require_side(backend).binder.counts().mismatches == 1
    finally:
        backend.close()


def test_entries_of_an_ended_stream_do_not_block_todays_path(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path)
    try:
        stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert stream.wait_ended(BOUND_S)
        assert backend.batch_get_v1(keys[1:3], slots([DST[2], DST[1]])) == [True, True]  # stale: forgotten
        assert require_side(backend).binder.counts().mismatches == 0 and require_side(backend).binder.bound_pages() == N - 2
    finally:
        backend.close()


def test_rebinding_slots_of_an_ended_stream_replaces_it(tmp_path) -> None:
    backend, pool, keys, want = streamed(tmp_path)
    try:
        first = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
        assert first.wait_ended(BOUND_S)
        second = require_side(backend).binder.bind(parse_keys(keys), slots(DST))  # SGLang reused the slots for a new hit
        assert second is not first and second.wait_ended(BOUND_S)
        assert backend.batch_get_v1(keys, slots(DST)) == [True] * N
        assert require_side(backend).binder.counts().mismatches == 0 and dst_bytes(pool) == want
    finally:
        backend.close()


def test_close_cancels_and_waits_for_streams(tmp_path) -> None:
    backend, pool, keys, _ = streamed(tmp_path)
    hold = Hold(group=0)
    require_side(backend).binder.observer = hold
    stream = require_side(backend).binder.bind(parse_keys(keys), slots(DST))
    assert hold.reached.wait(BOUND_S)
    closer = threading.Thread(target=backend.close)
    closer.start()
    assert stream.wait_group(3, 0, timeout=BOUND_S) is GroupVerdict.FAILED  # close cancelled it first
    hold.release()
    closer.join(BOUND_S)
    assert not closer.is_alive() and stream.ended and require_side(backend).binder.live_streams() == 0
    assert require_side(backend).binder.bind(parse_keys(keys), slots(DST)) is None
    require_side(backend).bind_hit(keys, slots(DST))  # never raises, binds nothing
    assert require_side(backend).binder.bound_pages() == 0


@pytest.mark.parametrize("streaming, layout", [("off", "layer_first"), ("on", "page_first")])
def test_without_streaming_nothing_binds_and_reads_are_as_before(tmp_path, caplog, streaming, layout) -> None:
    caplog.set_level(logging.WARNING, logger="sgl_kvtier.sglang.storage")
    pool = mha_host_pool(layout, layers=8, heads=4, head_dim=64, tokens=256)
    backend, pool, keys, want = streamed(tmp_path, pool=pool, streaming=streaming)
    try:
        assert not require_side(backend).enabled
        require_side(backend).bind_hit(keys, slots(DST))
        assert require_side(backend).binder.bound_pages() == 0 and require_side(backend).binder.live_streams() == 0
        assert require_side(backend).binder.bind(parse_keys(keys), slots(DST)) is None
        assert backend.batch_get_v1(keys, slots(DST)) == [True] * N and dst_bytes(pool) == want
        said = [r for r in caplog.records if "streaming" in r.getMessage()]
        if streaming == "on":
            assert len(said) == 1 and "page_first does not stream" in said[0].getMessage()
        else:
            assert said == []
        assert require_side(backend).binder.counts().streams_bound == 0 and backend.telemetry().boundary.total == 0
    finally:
        backend.close()


def test_streaming_on_a_streamable_layout_is_enabled(tmp_path) -> None:
    backend, pool, keys, _ = streamed(tmp_path)
    try:
        assert require_side(backend).enabled and backend.kv.namespace.parts == backend.kv.pages.plan.parts
        require_side(backend).bind_hit([], torch.empty(0, dtype=torch.int64))  # an empty hit
        require_side(backend).bind_hit(keys, slots(DST[:3])[:-1])  # not page-aligned: refused at the boundary
        assert require_side(backend).binder.bound_pages() == 0 and require_side(backend).binder.counts().streams_bound == 0
        assert backend.telemetry().boundary.expected == 1
    finally:
        backend.close()
