"""On-disk record formats: round trips, and damage is detected rather than decoded."""

from __future__ import annotations

import numpy as np
import pytest

from sgl_kvtier.errors import CorruptRecordError
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import journal as jr
from sgl_kvtier.store import journal_write as jw

K = bytes(range(32))


def test_records_round_trip_and_stop_at_a_torn_tail():
    data = fmt.journal_file_header(3) + jw.put_record(1, K, 7, 99, None) + jw.del_record(2, K)
    start = fmt.JOURNAL_FILE_HEADER_BYTES
    assert fmt.check_journal_file_header(data, "j") == 3
    recs = [r for _, r in fmt.iter_records(data, start)]
    assert recs == [[fmt.PUT, 1, K, 7, 99, None], [fmt.DEL, 2, K]]
    for cut in range(start, len(data)):
        got = [r for _, r in fmt.iter_records(data[:cut], start)]
        assert got in ([], recs[:1])
    flipped = bytearray(data)
    flipped[-3] ^= 1
    assert [r for _, r in fmt.iter_records(bytes(flipped), start)] == recs[:1]


def test_records_with_wrong_shapes_are_rejected():
    bad = fmt.pack_record([fmt.PUT, 1, b"short", 7, 99, None]) + fmt.pack_record([fmt.DEL, 2, K])
    assert list(fmt.iter_records(bad, 0)) == []


def test_headers_and_checkpoints_refuse_damage():
    blob = fmt.pack_header(fmt.HEADER_MAGIC, {"a": 1})
    assert fmt.unpack_header(fmt.HEADER_MAGIC, blob, "h")["a"] == 1
    with pytest.raises(CorruptRecordError):
        fmt.unpack_header(fmt.REGION_MAGIC, blob, "h")
    with pytest.raises(CorruptRecordError):
        fmt.unpack_header(fmt.HEADER_MAGIC, blob[:-1] + b"\0", "h")
    ck = fmt.pack_checkpoint({"x": 2})
    assert fmt.unpack_checkpoint(ck, "c")["x"] == 2
    with pytest.raises(CorruptRecordError):
        fmt.unpack_checkpoint(ck[:10], "c")


def test_checkpoint_then_journal_replay(tmp_path):
    other, third = bytes(32), bytes([9]) * 32
    jw.write_checkpoint(tmp_path, [K, other], np.array([0, 1]), np.array([5, 6], dtype=np.uint64),
                        np.array([-1, 0]), seq=2, generation=1)
    j = jw.Journal(tmp_path, 1)
    j.append([jw.put_record(3, third, 1, 8, K)])  # takes slot 1 from `other`
    j.close()
    state = jr.recover(tmp_path)
    assert list(state.slot_of) == [K, third] and state.key_of == {0: K, 1: third}
    assert state.checksum == {0: 5, 1: 8} and state.parent == {1: 0}
    assert state.seq == 3 and state.generation == 2


def test_replayed_links_to_reused_slots_are_dropped(tmp_path):
    a, b, c = bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32
    jw.write_checkpoint(tmp_path, [a, b], np.array([0, 1]), np.array([1, 2], dtype=np.uint64),
                        np.array([-1, 0]), seq=2, generation=1)
    j = jw.Journal(tmp_path, 1)
    j.append([jw.del_record(3, a), jw.put_record(4, c, 0, 9, None)])  # slot 0 now holds c, not b's parent
    j.close()
    state = jr.recover(tmp_path)
    assert state.parent == {} and state.slot_of == {b: 1, c: 0}


def test_slot_trailers_round_trip_and_refuse_damage():
    ns, inc, parent = bytes(range(16)), bytes([7]) * 16, bytes([3]) * 32
    raw = fmt.pack_trailer(ns, K, parent, inc, 41, [123456789])
    assert len(raw) == fmt.trailer_bytes(1)
    assert fmt.unpack_trailer(raw + bytes(100)) == fmt.Trailer(ns, K, parent, inc, 41, (123456789,))
    assert fmt.unpack_trailer(fmt.pack_trailer(ns, K, None, inc, 1, [1, 2, 3])) == fmt.Trailer(ns, K, None, inc, 1, (1, 2, 3))
    for at in range(len(raw)):  # any single flipped bit: refused, never decoded
        bad = bytearray(raw)
        bad[at] ^= 0x10
        assert fmt.unpack_trailer(bytes(bad)) is None
    assert fmt.unpack_trailer(raw[:-1]) is None and fmt.unpack_trailer(bytes(4096)) is None


def test_a_slot_holds_the_page_then_its_trailer_rounded_to_4k():
    assert fmt.slot_bytes_for(16384) == 16384 + 4096
    assert fmt.slot_bytes_for(4096 - fmt.trailer_bytes(1)) == 4096
    assert fmt.slot_bytes_for(4096 - fmt.trailer_bytes(1) + 1) == 8192
    assert fmt.slot_bytes_for(3072) == 4096
