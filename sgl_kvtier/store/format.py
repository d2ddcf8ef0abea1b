"""On-disk formats, bytes only (no IO policy). FORMAT_VERSION covers everything in this file.

Format 2: writer identity, an index rebuildable from the data alone (slot trailers), per-part checksums. A
store of another format is refused at open, never misread (its pages are a cache, recomputed).

Where things live (``<meta>`` = ``meta_dir`` or else the first device; ``<wid>`` = ``<host_id>-<k>``):
    <meta>/ns-<digest>/HEADER                namespace header: namespace, slot_bytes, parts, devices, store_id.
                                             Made once: a private tmp file hard-linked into place (a link never
                                             replaces a file, so of two first writers one wins, the other
                                             reads and uses its header).
    <meta>/ns-<digest>/w-<wid>/              one per writer (a process x a namespace shard): LOCK (flock, the
                                             owner on this host), LEASE, CONFIG, journal-*.log,
                                             checkpoint.bin, FENCE (``sharing = "cluster"``)
    <dev>/ns-<digest>/HEADER                 per-device header (as the namespace header, plus device_index)
    <dev>/ns-<digest>/w-<wid>/seg-NNNNN.dat  that writer's preallocated segments
    raw block device: one region per (namespace digest, wid) in the device's region table
Every file and region has one writer process (and FENCE its retirer, below); readers never write them.

Headers (namespace, device, region table; payloads are msgpack maps carrying ``format_version``):
    MAGIC (8 bytes) | u32 payload length | u64 xxh3-64 of payload | payload
    A header that is short, has another magic, or fails its checksum is refused, never guessed at.

Lease ``LEASE`` (in a writer's directory): two blocks of LEASE_BLOCK_BYTES at offsets 0 and LEASE_BLOCK_BYTES,
    rewritten alternately (block ``counter % 2``), each a header (LEASE_MAGIC) zero-padded to the block:
    wid, host_id, machine_id, boot_id, pid, incarnation (16 bytes, new per open), counter, heartbeat_s,
    pages, bytes_used, capacity_bytes, age_hist (bytes of pages per age bucket), journal [generation, bytes
    synced] (a reader of another host replays no further: sharing = "cluster").
    The valid block with the higher counter is the lease; a torn block is simply the older one.

Fence ``FENCE`` (in a writer's directory; ``sharing = "cluster"``): created empty by the owner at open. A
    live writer of another host that retires this (dead) writer writes ONE block of LEASE_BLOCK_BYTES at
    offset 0, a header (FENCE_MAGIC) zero-padded: incarnation (the retired one, from its last lease), by (the
    retiring wid), by_host, at (wall-clock seconds, informative only), with pwrite + fsync BEFORE any of the
    writer's files is deleted (crash rule: a directory with files missing always carries its fence). The
    owner reads it at every beat (O_DIRECT where possible) and stops writing there once it names its own
    incarnation; readers drop a fenced writer. An empty, short or torn fence is no fence.

Journal file ``journal-<generation:08d>.log`` (one writer's):
    file header:  JOURNAL_MAGIC (8) | u32 FORMAT_VERSION | u64 generation
    records:      u32 payload length | u32 xxh32 of payload | payload (msgpack array)
        PUT    [1, seq, key(32 bytes), slot, checksum, parent key (32 bytes) or nil]
               checksum: u64 xxh3-64 of the page when the shard has one part, else a list of one u64 per part
        DEL    [2, seq, key]
        TOUCH  [3, seq, key]   this writer read ``key`` from another writer's segments: that writer counts
                               it as a use (its owner tails this journal); replay of one's own journal skips it
    Replay stops at the first record that is short or fails its checksum (a torn tail after a crash);
    everything before it is trusted, nothing after it is.

Checkpoint file ``checkpoint.bin`` (replaced atomically: write tmp, fsync, rename, fsync dir):
    CHECKPOINT_MAGIC (8) | u64 payload length | u64 xxh3-64 of payload | payload (msgpack map):
        version, generation (first journal generation NOT contained), seq, high_water,
        keys (n*32 bytes), slots (int64[n]), checksums (uint64[n * parts]), parents (int64[n]: index into keys or -1)
    Entries are in eviction order, coldest first.

Slot (``slot_bytes`` = page bytes + trailer, rounded up to 4 KiB): the page's bytes at offset 0, then the
trailer at ``page_bytes``, written in the same IO as the page:
    TRAILER_MAGIC (8) | u32 FORMAT_VERSION | u16 parts | u16 flags (bit 0: has parent) | namespace digest (16)
    | key (32) | parent key (32, zeros without) | writer incarnation (16) | u64 seq | parts x u64 checksums
    | u64 xxh3-64 of everything before it in the trailer
Reads verify every part of the page against the index's checksums (the trailer is not read). ``fsck
--rebuild`` reads every slot: a trailer that fails its own checksum, names another namespace, or whose
checksums the page bytes do not match (torn, stale) is skipped; of several good slots of one key the highest
seq wins.

Shared raw pool (``sharing = "cluster"`` with ``host_index``; ``media.shared_raw.superblock``,
``media.shared_raw.region_meta``): one raw device (an NVMe-oF namespace attached to several hosts)
formatted once by ``sgl-kvtier pool-format DEV --hosts H``. Every byte of it is read and written with
O_DIRECT, in whole 4 KiB blocks; nothing lives in a ``meta_dir``.
    [0, 4 KiB)        superblock: header (POOL_MAGIC): pool_id, hosts, device_index, device_count,
                      device_bytes, host_slots_at, host_slot_bytes, data_at, share_bytes. Written once.
    host slot h       at host_slots_at + h * HOST_SLOT_BYTES (h = 0..hosts-1), written by host h only:
                      [0, 8 KiB) host lease: two blocks (HOST_LEASE_MAGIC) as a writer's LEASE, the valid one
                      with the higher counter wins: host_id, machine_id, boot_id, pid, host_index, counter,
                      heartbeat_s; [HOST_TABLE_AT, +2 x HOST_TABLE_BYTES) region table A/B (HOST_TABLE_MAGIC):
                      generation, regions [{ns, wid, offset, length, data_at, slots, checkpoint_bytes,
                      journal_bytes, journals}]; the valid copy with the higher generation wins, a change
                      rewrites the other copy.
    data area         [data_at, data_at + hosts * share_bytes): host h's share is the h-th share_bytes; its
                      regions are carved from it, in table order, and from nothing else.
    region            (offsets from the region's start; one per (namespace digest, wid), on every device of
                      the pool; only the first device's carries the meta areas, the others' sizes are 0):
        REGION_HEADER_AT      the region's header (HEADER_MAGIC: the device header of a directory device).
                              Its first byte is the writer's lock: an OFD ``fcntl`` write lock, host-local.
        REGION_LEASE_AT       LEASE: two blocks, exactly a writer's LEASE file (plus host_index).
        REGION_CONFIG_AT      CONFIG: a header (CONFIG_MAGIC) {config: the writer's config mapping}.
        REGION_CHECKPOINT_AT  two checkpoint areas of checkpoint_bytes: a header block (CHECKPOINT_AREA_MAGIC:
                              serial, generation, length) then the checkpoint file's bytes (CHECKPOINT_MAGIC,
                              as above). The valid one (header and checkpoint checksums) with the higher serial
                              wins; a checkpoint rewrites the other area: its bytes, fdatasync, then its header.
        journal areas         ``journals`` areas of journal_bytes; generation g uses area g % journals:
                              JOURNAL_AREA_MAGIC | u32 FORMAT_VERSION | u64 generation, then records framed as
                              a journal file's but with the xxh32 SEEDED by ``area_seed(generation)``, so a record
                              of an older generation left beyond the tail fails its checksum: replay of an area
                              stops at the first record that is short, torn or of another generation. A
                              generation may take an area only when the durable checkpoint covers the
                              generation the area held (else the writer checkpoints in place first).
                              Read through a region view (``media.shared_raw.region_meta.RegionFiles``), an
                              area is presented as the journal file ``journal-<g>.log``: JOURNAL_MAGIC header,
                              its valid records with their unseeded xxh32, the same offsets; an area holding
                              another generation is no such file.
        data_at               ``slots`` slots of slot_bytes, as a segment's.

Parts: the namespace header's ``parts`` lists the byte length of each checksummed range of a page, in
order (default: one part, the whole page); they are the namespace's (``Namespace.part_sizes()``, part of its
digest when there are several), and a header with other ones is refused. A part is verified as soon as its
bytes land (``store.part_reads``: group-major reads); a page is a hit only if all its parts pass
(``store.parts``).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import xxhash

from sgl_kvtier.errors import CorruptRecordError

FORMAT_VERSION = 2
HEADER_MAGIC = b"KVTIERH1"
REGION_MAGIC = b"KVTIERB1"
JOURNAL_MAGIC = b"KVTIERJ1"
CHECKPOINT_MAGIC = b"KVTIERC1"
LEASE_MAGIC = b"KVTIERL2"
TRAILER_MAGIC = b"KVTIERS2"
FENCE_MAGIC = b"KVTIERF2"
LEASE_BLOCK_BYTES = 4096
POOL_MAGIC = b"KVTIERP2"
HOST_LEASE_MAGIC = b"KVTIERO2"
HOST_TABLE_MAGIC = b"KVTIERT2"
CONFIG_MAGIC = b"KVTIERG2"
CHECKPOINT_AREA_MAGIC = b"KVTIERK2"
JOURNAL_AREA_MAGIC = b"KVTIERJ2"
POOL_BLOCK = 4096  # every read and write of a shared raw pool: whole, aligned blocks of this size
HOST_SLOTS_AT = 1 << 20
HOST_SLOT_BYTES = 256 << 10
HOST_TABLE_AT = 8192
HOST_TABLE_BYTES = 124 << 10
REGION_HEADER_AT, REGION_LEASE_AT, REGION_CONFIG_AT, REGION_CHECKPOINT_AT = 0, 4096, 12288, 65536
REGION_CONFIG_BYTES = REGION_CHECKPOINT_AT - REGION_CONFIG_AT
JOURNAL_AREAS = 4

_HEADER = struct.Struct("<8sIQ")
_JOURNAL_FILE = struct.Struct("<8sIQ")
_RECORD = struct.Struct("<II")
_CHECKPOINT = struct.Struct("<8sQQ")

PUT, DEL, TOUCH = 1, 2, 3
MAX_RECORD_BYTES = 1 << 16
BLOCK_HEADER_BYTES = 1 << 20  # reserved at the start of a raw block device for the region table


def pack_header(magic: bytes, fields: dict[str, Any]) -> bytes:
    payload: bytes = msgpack.packb({"format_version": FORMAT_VERSION, **fields})
    return _HEADER.pack(magic, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def header_bytes(data: bytes) -> int:
    """How many bytes the header at the start of ``data`` takes (its prefix and payload); 0 if none fits."""
    return _HEADER.size + _HEADER.unpack_from(data)[1] if len(data) >= _HEADER.size else 0


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


def area_seed(generation: int) -> int:
    """The xxh32 seed of the records of a journal area holding ``generation`` (never 0: a journal file's)."""
    return (generation + 1) & 0xFFFFFFFF or 1


def seal_record(record: bytes, seed: int) -> bytes:
    """A packed record (``pack_record``) with its xxh32 taken under ``seed`` instead (0: as packed)."""
    length = _RECORD.unpack_from(record)[0]
    payload = record[_RECORD.size:_RECORD.size + length]
    return _RECORD.pack(length, xxhash.xxh32_intdigest(payload, seed)) + payload


def unseal_records(data: bytes, start: int, seed: int) -> tuple[int, bytes, bool]:
    """Records of ``data`` from ``start`` sealed under ``seed``, until one is short, empty or fails: (the offset
    after the last good one, those records with their unseeded xxh32, whether it stopped only because the
    data ended)."""
    out: list[bytes] = []
    pos, end = start, len(data)
    while True:
        if pos + _RECORD.size > end:
            return pos, b"".join(out), True
        length, crc = _RECORD.unpack_from(data, pos)
        body = pos + _RECORD.size
        if not 0 < length <= MAX_RECORD_BYTES:
            return pos, b"".join(out), False
        if body + length > end:
            return pos, b"".join(out), True
        payload = data[body:body + length]
        if xxhash.xxh32_intdigest(payload, seed) != crc:
            return pos, b"".join(out), False
        out.append(_RECORD.pack(length, xxhash.xxh32_intdigest(payload)) + payload)
        pos = body + length


def journal_area_header(generation: int) -> bytes:
    """The first bytes of a journal area holding ``generation`` (as a journal file's header)."""
    return _JOURNAL_FILE.pack(JOURNAL_AREA_MAGIC, FORMAT_VERSION, generation)


def journal_area_generation(data: bytes) -> int | None:
    """The generation a journal area's first bytes name, or None (empty, another magic or format)."""
    if len(data) < _JOURNAL_FILE.size:
        return None
    magic, version, generation = _JOURNAL_FILE.unpack_from(data)
    return int(generation) if magic == JOURNAL_AREA_MAGIC and version == FORMAT_VERSION else None


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
        return (len(r) == 6 and isinstance(r[3], int) and r[3] >= 0 and _valid_checksum(r[4])
                and (r[5] is None or (isinstance(r[5], bytes) and len(r[5]) == 32)))
    return r[0] in (DEL, TOUCH) and len(r) == 3


def _valid_checksum(c: Any) -> bool:
    return isinstance(c, int) or (isinstance(c, list) and bool(c) and all(isinstance(x, int) for x in c))


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
        raise CorruptRecordError(
            f"{what}: checkpoint format {fields.get('version')}, this build reads {FORMAT_VERSION}")
    return fields


def checkpoint_intact(data: bytes) -> bool:
    """Whether ``data`` starts with a whole checkpoint whose payload passes its checksum (not decoded)."""
    if len(data) < _CHECKPOINT.size:
        return False
    magic, length, crc = _CHECKPOINT.unpack_from(data)
    payload = data[_CHECKPOINT.size:_CHECKPOINT.size + length]
    return bool(magic == CHECKPOINT_MAGIC and len(payload) == length and xxhash.xxh3_64_intdigest(payload) == crc)


# ---------------------------------------------------------------------------------------------- lease, fence
def pack_fence_block(fields: dict[str, Any]) -> bytes:
    """The one FENCE block (FENCE_MAGIC header, zero-padded to LEASE_BLOCK_BYTES)."""
    return pack_header(FENCE_MAGIC, fields).ljust(LEASE_BLOCK_BYTES, b"\0")


def unpack_fence(data: bytes, what: str) -> dict[str, Any] | None:
    """The fence in a FENCE file's first bytes, or None when there is none (empty, short, torn, zeros)."""
    try:
        return unpack_header(FENCE_MAGIC, data[:LEASE_BLOCK_BYTES], what)
    except CorruptRecordError:
        return None


def pack_lease_block(fields: dict[str, Any]) -> bytes:
    """One lease block (LEASE_MAGIC header, zero-padded to LEASE_BLOCK_BYTES)."""
    data = pack_header(LEASE_MAGIC, fields)
    if len(data) > LEASE_BLOCK_BYTES:
        raise ValueError(f"lease of {len(data)} bytes does not fit a {LEASE_BLOCK_BYTES}-byte block")
    return data.ljust(LEASE_BLOCK_BYTES, b"\0")


def unpack_lease(data: bytes, what: str) -> dict[str, Any]:
    """The lease in a LEASE file's bytes: the valid block with the higher ``counter``.

    Raises CorruptRecordError when neither block is valid (a lease being created, or damage)."""
    found = []
    for at in (0, LEASE_BLOCK_BYTES):
        try:
            found.append(unpack_header(LEASE_MAGIC, data[at:at + LEASE_BLOCK_BYTES], what))
        except CorruptRecordError:
            continue
    if not found:
        raise CorruptRecordError(f"{what}: no valid lease block")
    return max(found, key=lambda f: int(f.get("counter", -1)))


# -------------------------------------------------------------------------------------------- trailer
_TRAILER = struct.Struct("<8sIHH16s32s32s16sQ")
TRAILER_HAS_PARENT = 1


def trailer_bytes(parts: int) -> int:
    """Size of a slot trailer for a page of ``parts`` checksummed parts."""
    return _TRAILER.size + 8 * parts + 8


def slot_bytes_for(page_bytes: int, parts: int = 1, align: int = 4096) -> int:
    """A slot's size: the page, then its trailer, rounded up to ``align``."""
    return -(-(page_bytes + trailer_bytes(parts)) // align) * align


def pack_trailer(ns_digest: bytes, key: bytes, parent: bytes | None, incarnation: bytes, seq: int,
                 checksums: list[int]) -> bytes:
    """A slot trailer (see the module docstring) for one written page."""
    head = _TRAILER.pack(TRAILER_MAGIC, FORMAT_VERSION, len(checksums), TRAILER_HAS_PARENT if parent else 0,
                         ns_digest, key, parent or bytes(32), incarnation, seq)
    body = head + struct.pack(f"<{len(checksums)}Q", *checksums)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


@dataclasses.dataclass(frozen=True)
class Trailer:
    """A decoded slot trailer."""

    ns_digest: bytes
    key: bytes
    parent: bytes | None
    incarnation: bytes
    seq: int
    checksums: tuple[int, ...]


def unpack_trailer(data: bytes) -> Trailer | None:
    """The trailer at the start of ``data``, or None when there is none or it fails its checksum."""
    if len(data) < _TRAILER.size + 16 or data[:8] != TRAILER_MAGIC:
        return None
    magic, version, parts, flags, ns, key, parent, inc, seq = _TRAILER.unpack_from(data)
    end = _TRAILER.size + 8 * parts
    if version != FORMAT_VERSION or parts < 1 or len(data) < end + 8:
        return None
    if struct.unpack_from("<Q", data, end)[0] != xxhash.xxh3_64_intdigest(data[:end]):
        return None
    sums = struct.unpack_from(f"<{parts}Q", data, _TRAILER.size)
    return Trailer(ns, key, parent if flags & TRAILER_HAS_PARENT else None, inc, seq, tuple(sums))


WRITER_PREFIX = "w-"


def writer_dirname(wid: str) -> str:
    """The directory name of writer ``wid`` (``w-<wid>``)."""
    return WRITER_PREFIX + wid
