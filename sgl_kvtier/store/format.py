"""On-disk formats, bytes only (no IO policy). FORMAT_VERSION covers everything in this file.

Headers (one per device per namespace shard; also the block-device region table):
    MAGIC (8 bytes) | u32 payload length | u64 xxh3-64 of payload | payload (msgpack map)
    A header that is short, has another magic, or fails its checksum is refused, never guessed at.

Journal file ``journal-<generation:08d>.log``:
    file header:  JOURNAL_MAGIC (8) | u32 FORMAT_VERSION | u64 generation
    records:      u32 payload length | u32 xxh32 of payload | payload (msgpack array)
        PUT  [1, seq, key(32 bytes), slot, checksum(u64), parent key (32 bytes) or nil]
        DEL  [2, seq, key]
    Replay stops at the first record that is short or fails its checksum (a torn tail after a crash);
    everything before it is trusted, nothing after it is.

Checkpoint file ``checkpoint.bin`` (replaced atomically: write tmp, fsync, rename, fsync dir):
    CHECKPOINT_MAGIC (8) | u64 payload length | u64 xxh3-64 of payload | payload (msgpack map):
        version, generation (first journal generation NOT contained), seq, high_water,
        keys (n*32 bytes), slots (int64[n]), checksums (uint64[n]), parents (int64[n]: index into keys or -1)
    Entries are in eviction order, coldest first.

Slots hold raw page bytes only, at ``slot * slot_bytes`` in the device's arena; slot_bytes is the page size
rounded up to 4 KiB. A page's checksum lives in its index record, so a torn or stale slot reads as a miss.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import xxhash

from sgl_kvtier.errors import CorruptRecordError

FORMAT_VERSION = 1
HEADER_MAGIC = b"KVTIERH1"
REGION_MAGIC = b"KVTIERB1"
JOURNAL_MAGIC = b"KVTIERJ1"
CHECKPOINT_MAGIC = b"KVTIERC1"

_HEADER = struct.Struct("<8sIQ")
_JOURNAL_FILE = struct.Struct("<8sIQ")
_RECORD = struct.Struct("<II")
_CHECKPOINT = struct.Struct("<8sQQ")

PUT, DEL = 1, 2
MAX_RECORD_BYTES = 1 << 16
BLOCK_HEADER_BYTES = 1 << 20  # reserved at the start of a raw block device for the region table


def pack_header(magic: bytes, fields: dict[str, Any]) -> bytes:
    payload: bytes = msgpack.packb({"format_version": FORMAT_VERSION, **fields})
    return _HEADER.pack(magic, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def unpack_header(magic: bytes, data: bytes, what: str) -> dict[str, Any]:
    if len(data) < _HEADER.size:
        raise CorruptRecordError(f"{what}: header is {len(data)} bytes, too short")
    got_magic, length, crc = _HEADER.unpack_from(data)
    if got_magic != magic:
        raise CorruptRecordError(f"{what}: not an sgl-kvtier header (magic {got_magic!r})")
    payload = data[_HEADER.size:_HEADER.size + length]
    if len(payload) != length or xxhash.xxh3_64_intdigest(payload) != crc:
        raise CorruptRecordError(f"{what}: header checksum mismatch")
    fields: dict[str, Any] = msgpack.unpackb(payload)
    return fields


def journal_file_header(generation: int) -> bytes:
    return _JOURNAL_FILE.pack(JOURNAL_MAGIC, FORMAT_VERSION, generation)


JOURNAL_FILE_HEADER_BYTES = _JOURNAL_FILE.size


def check_journal_file_header(data: bytes, what: str) -> int:
    if len(data) < _JOURNAL_FILE.size:
        raise CorruptRecordError(f"{what}: journal header is torn")
    magic, version, generation = _JOURNAL_FILE.unpack_from(data)
    if magic != JOURNAL_MAGIC:
        raise CorruptRecordError(f"{what}: not an sgl-kvtier journal")
    if version != FORMAT_VERSION:
        raise CorruptRecordError(f"{what}: journal format {version}, this build reads {FORMAT_VERSION}")
    return int(generation)


def pack_record(fields: list[Any]) -> bytes:
    payload: bytes = msgpack.packb(fields)
    return _RECORD.pack(len(payload), xxhash.xxh32_intdigest(payload)) + payload


def iter_records(data: bytes, start: int) -> Iterator[tuple[int, list[Any]]]:
    """Yield ``(end_offset, record)`` until the data ends or a record is torn or corrupt."""
    pos, end = start, len(data)
    while pos + _RECORD.size <= end:
        length, crc = _RECORD.unpack_from(data, pos)
        body = pos + _RECORD.size
        if length > MAX_RECORD_BYTES or body + length > end:
            return
        payload = data[body:body + length]
        if xxhash.xxh32_intdigest(payload) != crc:
            return
        try:
            record = msgpack.unpackb(payload)
        except (ValueError, msgpack.exceptions.ExtraData):
            return
        if not valid_record(record):
            return
        pos = body + length
        yield pos, record


def valid_record(r: Any) -> bool:
    if not isinstance(r, list) or len(r) < 3 or not isinstance(r[2], bytes) or len(r[2]) != 32:
        return False
    if r[0] == PUT:
        return (len(r) == 6 and isinstance(r[3], int) and r[3] >= 0 and isinstance(r[4], int)
                and (r[5] is None or (isinstance(r[5], bytes) and len(r[5]) == 32)))
    return r[0] == DEL and len(r) == 3


def pack_checkpoint(fields: dict[str, Any]) -> bytes:
    payload: bytes = msgpack.packb({"version": FORMAT_VERSION, **fields})
    return _CHECKPOINT.pack(CHECKPOINT_MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def unpack_checkpoint(data: bytes, what: str) -> dict[str, Any]:
    if len(data) < _CHECKPOINT.size:
        raise CorruptRecordError(f"{what}: checkpoint is torn")
    magic, length, crc = _CHECKPOINT.unpack_from(data)
    payload = data[_CHECKPOINT.size:_CHECKPOINT.size + length]
    if magic != CHECKPOINT_MAGIC or len(payload) != length or xxhash.xxh3_64_intdigest(payload) != crc:
        raise CorruptRecordError(f"{what}: checkpoint fails its checksum")
    fields: dict[str, Any] = msgpack.unpackb(payload)
    if fields.get("version") != FORMAT_VERSION:
        raise CorruptRecordError(f"{what}: checkpoint format {fields.get('version')}, this build reads {FORMAT_VERSION}")
    return fields
