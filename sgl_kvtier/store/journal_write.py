"""The writer's side of the durable index (formats in ``store.format``; replay and the crash rules of the
whole index in ``store.journal``): its journal file of one generation, the packed records, the checkpoint.

Crash rules made here:
  * A new journal file's header is fsynced, and its directory, before any record goes in; one whose header
    cannot be written is removed before the error leaves (replay would treat it as empty and torn).
  * ``Journal.synced`` is the size before the last fsync that returned: what a lease may announce.
  * ``replace_checkpoint`` writes ``checkpoint.bin`` atomically (tmp, fsync, rename, fsync the directory) and
    only then deletes the journals below its generation: a crash leaves the old checkpoint with all its
    journals, or the new one.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import numpy as np

from sgl_kvtier.keys import PageKey
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.devices import fsync_dir, write_file_atomic
from sgl_kvtier.store.journal import CHECKPOINT, journal_generations, journal_path
from sgl_kvtier.store.lifecycle import Step, abandon
from sgl_kvtier.store.parts import Checksum, sums_list


class Journal:
    """The writer's journal file of one generation. Not thread-safe: the store serialises appends."""

    nearly_full = False  # a file grows as needed (a shared raw pool's journal areas do not: ``room``)

    def __init__(self, meta: Path, generation: int):
        self.meta = meta
        self.generation = generation
        self.path = journal_path(meta, generation)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.records = 0
        self.size = 0  # bytes in the file (its header and every record appended)
        self.synced = 0  # bytes known durable: the size before the last fsync that returned
        fresh = False
        try:
            self.size = os.fstat(self._fd).st_size
            fresh = self.size == 0
            if fresh:
                os.write(self._fd, fmt.journal_file_header(generation))
                os.fsync(self._fd)
                fsync_dir(meta)
                self.size = self.synced = fmt.JOURNAL_FILE_HEADER_BYTES
        except BaseException as exc:
            # Crash rule: a journal whose header did not make it (ENOSPC, EIO) holds no record; it is removed
            # here, and if a crash comes first, replay treats its torn header as an empty, torn journal.
            steps: list[Step] = [("journal fd", self.close)]
            if fresh:
                steps.append(("half-made journal", partial(self.path.unlink, missing_ok=True)))
            abandon(exc, str(self.path), steps)
            raise

    def append(self, records: list[bytes]) -> None:
        """Append packed records (one write; durable only after ``sync``)."""
        if records:
            data = b"".join(records)
            os.write(self._fd, data)
            self.records += len(records)
            self.size += len(data)

    def room(self) -> int | None:
        """Bytes it may still grow by: None, no bound."""
        return None

    def sync(self) -> None:
        """fsync the journal file; ``synced`` becomes the size it had before (every record appended by then)."""
        size = self.size
        os.fsync(self._fd)
        self.synced = size

    def close(self) -> None:
        """Close the journal file (not synced here). Idempotent: the descriptor is detached first, so a close
        that reports an error (Linux frees the descriptor all the same) is never retried."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def touch_record(seq: int, key: PageKey) -> bytes:
    """A packed TOUCH record: this writer read ``key``'s page from another writer's segments."""
    return fmt.pack_record([fmt.TOUCH, seq, key])


def record_estimate(parts: int) -> int:
    """Bytes a journal record (``put_record``, ``del_record``) of a page of ``parts`` parts takes at most in
    practice (a PUT with a parent): what a bounded journal area is sized and its room checked by."""
    return 112 + 9 * parts


def put_record(seq: int, key: PageKey, slot: int, checksum: Checksum, parent: PageKey | None) -> bytes:
    """A packed PUT record: ``key``'s page is in ``slot`` with ``checksum`` (several parts: a list of
    one u64 per part), chained on ``parent``."""
    return fmt.pack_record([fmt.PUT, seq, key, slot, checksum if isinstance(checksum, int) else sums_list(checksum),
                            parent])


def del_record(seq: int, key: PageKey) -> bytes:
    """A packed DEL record: ``key``'s page is gone."""
    return fmt.pack_record([fmt.DEL, seq, key])


def write_checkpoint(meta: Path, keys: list[PageKey], slots: np.ndarray, checksums: np.ndarray,
                     parents: np.ndarray, seq: int, generation: int) -> None:
    """Persist an index (coldest first; ``parents[i]`` indexes ``keys`` or is -1) as covering every
    journal generation below ``generation``, then delete those journals."""
    replace_checkpoint(meta, checkpoint_blob(keys, slots, checksums, parents, seq, generation), generation)


def checkpoint_blob(keys: list[PageKey], slots: np.ndarray, checksums: np.ndarray, parents: np.ndarray,
                    seq: int, generation: int) -> bytes:
    """A checkpoint's bytes (``format.pack_checkpoint``) of an index snapshot (``PageIndex.snapshot``)."""
    return fmt.pack_checkpoint({
        "generation": generation,
        "seq": seq,
        "keys": b"".join(keys),
        "slots": np.asarray(slots, dtype=np.int64).tobytes(),
        "checksums": np.asarray(checksums, dtype=np.uint64).tobytes(),
        "parents": np.asarray(parents, dtype=np.int64).tobytes(),
    })


def replace_checkpoint(meta: Path, blob: bytes, generation: int) -> None:
    """``blob`` as ``meta``'s checkpoint (tmp, fsync, rename, fsync the directory), then delete the journals
    below ``generation`` (which it covers)."""
    write_file_atomic(meta / CHECKPOINT, blob)
    for gen in journal_generations(meta):
        if gen < generation:
            journal_path(meta, gen).unlink(missing_ok=True)
    fsync_dir(meta)

