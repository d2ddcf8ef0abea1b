"""On-disk record formats: round trips, and damage is detected rather than decoded."""

from __future__ import annotations

import pytest

from sgl_kvtier.errors import CorruptRecordError
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store import journal as jr

K = bytes(range(32))


def test_records_round_trip_and_stop_at_a_torn_tail():
    data = fmt.journal_file_header(3) + jr.put_record(1, K, jr.Entry(7, 99, None)) + jr.del_record(2, K)
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
    other = bytes(32)
    jr.write_checkpoint(tmp_path, [(K, jr.Entry(0, 5, None)), (other, jr.Entry(1, 6, K))], seq=2, generation=1)
    j = jr.Journal(tmp_path, 1)
    j.append([jr.put_record(3, bytes([9]) * 32, jr.Entry(1, 8, K))])  # takes slot 1 from `other`
    j.close()
    state = jr.recover(tmp_path)
    assert list(state.entries) == [K, bytes([9]) * 32]
    assert state.entries[K].checksum == 5 and state.seq == 3 and state.generation == 2
