"""The durable index: an append-only journal plus periodic checkpoints (formats in ``store.format``).

Crash rules:
  * A PUT record is appended only after the page's data is written (and, unless durability is ``none``,
    fdatasync'd); so a record never points at bytes that were not written.
  * A writer never appends to a journal it did not create: on open it starts generation ``max + 1``, so a
    torn tail of an earlier run is simply where that file's replay stops.
  * Checkpoint: snapshot + rotate to a new generation under the store lock, write ``checkpoint.bin.tmp``,
    fsync, rename over ``checkpoint.bin``, fsync the directory, and only then delete the journals the
    checkpoint covers. A crash anywhere leaves either the old checkpoint with all its journals, or the new.
  * Replay order is checkpoint, then journals by generation; a PUT of a slot takes it from whichever key
    held it before (that key's bytes are gone).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sgl_kvtier.errors import CorruptRecordError
from sgl_kvtier.keys import KEY_BYTES, PageKey
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.devices import write_file_atomic

log = logging.getLogger(__name__)
CHECKPOINT = "checkpoint.bin"


def journal_path(meta: Path, generation: int) -> Path:
    return meta / f"journal-{generation:08d}.log"


def journal_generations(meta: Path) -> list[int]:
    gens = []
    for p in meta.glob("journal-*.log"):
        try:
            gens.append(int(p.stem.split("-")[1]))
        except (IndexError, ValueError):
            continue
    return sorted(gens)


@dataclass(slots=True)
class Entry:
    slot: int
    checksum: int
    parent: PageKey | None


@dataclass
class Recovered:
    """Index state rebuilt from disk; ``entries`` is in eviction order, coldest first."""

    entries: dict[PageKey, Entry] = field(default_factory=dict)
    seq: int = 0
    generation: int = 0  # the generation a new writer journal should use
    checkpoint_generation: int = 0
    replayed_records: int = 0
    torn_journals: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    owner: dict[int, PageKey] = field(default_factory=dict)  # slot -> key, for replaying more records later
    cursor: tuple[int, int] = (0, 0)  # (generation, byte offset) just past the last record replayed


def recover(meta: Path) -> Recovered:
    state = Recovered()
    owner = state.owner
    ckpt = meta / CHECKPOINT
    if ckpt.exists():
        try:
            fields = fmt.unpack_checkpoint(ckpt.read_bytes(), str(ckpt))
            _load_checkpoint(fields, state, owner)
        except (CorruptRecordError, ValueError, KeyError, TypeError) as exc:
            state.problems.append(f"checkpoint unreadable ({exc}); rebuilding from journals")
            log.warning("%s: %s", ckpt, state.problems[-1])
            state.entries.clear()
            owner.clear()
            state.checkpoint_generation = 0
    gens = [g for g in journal_generations(meta) if g >= state.checkpoint_generation]
    state.cursor = (state.checkpoint_generation, 0)
    for gen in gens:
        state.cursor = (gen, _replay(journal_path(meta, gen), state, owner))
    state.generation = max([state.checkpoint_generation - 1, *journal_generations(meta)], default=0) + 1
    return state


def _load_checkpoint(fields: dict[str, Any], state: Recovered, owner: dict[int, PageKey]) -> None:
    keys_blob: bytes = fields["keys"]
    n = len(keys_blob) // KEY_BYTES
    slots = np.frombuffer(fields["slots"], dtype=np.int64, count=n).tolist()
    sums = np.frombuffer(fields["checksums"], dtype=np.uint64, count=n).tolist()
    parents = np.frombuffer(fields["parents"], dtype=np.int64, count=n).tolist()
    keys = [keys_blob[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(n)]
    state.entries = {k: Entry(s, c, keys[p] if p >= 0 else None) for k, s, c, p in zip(keys, slots, sums, parents)}
    owner.update(zip(slots, keys))
    state.seq = fields["seq"]
    state.checkpoint_generation = fields["generation"]


def _replay(path: Path, state: Recovered, owner: dict[int, PageKey], start: int = 0) -> int:
    """Apply the records of one journal file from byte ``start``; returns the offset after the last good one."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return start
    if start == 0:
        try:
            fmt.check_journal_file_header(data, str(path))
        except CorruptRecordError as exc:
            state.problems.append(str(exc))
            state.torn_journals.append(path.name)
            return 0
        start = fmt.JOURNAL_FILE_HEADER_BYTES
    end = start
    entries = state.entries
    for end, rec in fmt.iter_records(data, start):
        state.replayed_records += 1
        state.seq = max(state.seq, rec[1])
        key = rec[2]
        old = entries.pop(key, None)
        if old is not None and owner.get(old.slot) == key:
            del owner[old.slot]
        if rec[0] == fmt.PUT:
            slot = rec[3]
            prev = owner.get(slot)
            if prev is not None:
                entries.pop(prev, None)
            owner[slot] = key
            entries[key] = Entry(slot, rec[4], rec[5])
    if end != len(data):
        state.torn_journals.append(path.name)
        state.problems.append(f"{path.name}: torn or corrupt after byte {end} of {len(data)}; the rest is ignored")
    return end


def follow(meta: Path, state: Recovered) -> bool:
    """Bring a reader's ``state`` up to date with what a live writer appended since; True if anything changed.

    Cheap when nothing changed (a stat or two). If the writer checkpointed past journals this reader had
    not finished, the state is rebuilt from the new checkpoint. A record missed in a race can only make a
    page look absent or stale, and a stale slot fails its checksum on read: never wrong bytes.
    """
    gen, offset = state.cursor
    path = journal_path(meta, gen)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        size = -1
    newer = journal_path(meta, gen + 1).exists()
    if size == offset and not newer:
        return False
    if size < 0:  # the writer checkpointed and removed this journal: start over from its checkpoint
        fresh = recover(meta)
        state.__dict__.update(fresh.__dict__)
        return True
    before = state.replayed_records
    problems = len(state.problems)
    state.cursor = (gen, _replay(path, state, state.owner, offset))
    while journal_path(meta, state.cursor[0] + 1).exists():
        nxt = state.cursor[0] + 1
        state.cursor = (nxt, _replay(journal_path(meta, nxt), state, state.owner))
    del state.problems[problems:]  # a live writer's tail is not damage
    state.torn_journals.clear()
    return state.replayed_records != before


class Journal:
    """The writer's journal file of one generation. Not thread-safe: the store serialises appends."""

    def __init__(self, meta: Path, generation: int):
        self.meta = meta
        self.generation = generation
        self.path = journal_path(meta, generation)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if os.fstat(self._fd).st_size == 0:
            os.write(self._fd, fmt.journal_file_header(generation))
            os.fsync(self._fd)
            _fsync_dir(meta)
        self.records = 0

    def append(self, records: list[bytes]) -> None:
        if records:
            os.write(self._fd, b"".join(records))
            self.records += len(records)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def put_record(seq: int, key: PageKey, entry: Entry) -> bytes:
    return fmt.pack_record([fmt.PUT, seq, key, entry.slot, entry.checksum, entry.parent])


def del_record(seq: int, key: PageKey) -> bytes:
    return fmt.pack_record([fmt.DEL, seq, key])


def write_checkpoint(meta: Path, entries: list[tuple[PageKey, Entry]], seq: int, generation: int) -> None:
    """Persist ``entries`` (coldest first) as covering every journal generation below ``generation``."""
    keys = [k for k, _ in entries]
    position = {k: i for i, k in enumerate(keys)}
    fields = {
        "generation": generation,
        "seq": seq,
        "keys": b"".join(keys),
        "slots": np.fromiter((e.slot for _, e in entries), dtype=np.int64, count=len(entries)).tobytes(),
        "checksums": np.fromiter((e.checksum for _, e in entries), dtype=np.uint64, count=len(entries)).tobytes(),
        "parents": np.fromiter((position.get(e.parent, -1) if e.parent is not None else -1 for _, e in entries),
                               dtype=np.int64, count=len(entries)).tobytes(),
    }
    write_file_atomic(meta / CHECKPOINT, fmt.pack_checkpoint(fields))
    for gen in journal_generations(meta):
        if gen < generation:
            journal_path(meta, gen).unlink(missing_ok=True)
    _fsync_dir(meta)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
