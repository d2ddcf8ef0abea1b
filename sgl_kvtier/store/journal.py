"""The durable index: an append-only journal plus periodic checkpoints, and their replay (formats in
``store.format``; the writer's side in ``store.journal_write``).

Crash rules:
  * A PUT record is appended only after the page's data is written (and, unless durability is ``none``,
    fdatasync'd), so a record never points at bytes that were not written.
  * A writer never appends to a journal it did not create: each open starts generation ``max + 1``, so a
    torn tail of an earlier run is where that file's replay stops.
  * Checkpoint: snapshot + rotate under the store lock, replace ``checkpoint.bin`` atomically, and only
    then delete the journals it covers. A crash, or a checkpoint failing at any step (ENOSPC, EIO), leaves
    either the old checkpoint with all its journals or the new one.
Replay: the checkpoint, then the journals by generation, each up to its first torn or corrupt record. A PUT
of a slot takes it from whichever key held it (that key's bytes are gone). A TOUCH changes nothing here: its
key goes to ``Recovered.touched`` for the page's owner, tailing this journal (``drain_touched``). Parts:
a checkpoint whose checksum column is not ``n * parts`` long is unreadable (journals are replayed instead)
and a PUT with another number of checksums indexes nothing (reported in ``problems``), so every indexed
page has exactly ``parts`` checksums.
Following a live writer (``follow``): ``pread`` from the cursor, never past a record not read whole, every
file read through an ``io.file_view.FileView`` (``POSIX``: a fresh open per read, close-to-open consistency
on NFS). ``sharing = "cluster"`` (``follow_announced``): only as far as the writer's leases announced
(generation -> bytes), by exact names, never a name past the announced generation (no negative lookup
cached before the file exists); lower generations are left only once read cleanly to what was announced.
Stuck (a journal missing, a generation it cannot leave): the checkpoint, once per announcement, is a fresh
start when past the cursor, else lag (view kept). A shared raw pool's region
(``media.shared_raw.region_meta``) is read back as these same files through its view.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sgl_kvtier.errors import CorruptRecordError
from sgl_kvtier.io.file_view import POSIX, FileView
from sgl_kvtier.keys import KEY_BYTES, PageKey
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.parts import Checksum, pack_sums

log = logging.getLogger(__name__)
CHECKPOINT = "checkpoint.bin"


def journal_path(meta: Path, generation: int) -> Path:
    """The journal file of ``generation`` in the shard's meta directory."""
    return meta / f"journal-{generation:08d}.log"



def journal_generations(meta: Path, view: FileView = POSIX) -> list[int]:
    """The generations of the journal files present, ascending."""
    gens = []
    for name in view.listdir(meta):
        if name.startswith("journal-") and name.endswith(".log"):
            try:
                gens.append(int(name[len("journal-"):-len(".log")]))
            except ValueError:
                continue
    return sorted(gens)


@dataclass
class Recovered:
    """Index state rebuilt from disk. ``slot_of`` is in eviction order, coldest first."""

    slot_of: dict[PageKey, int] = field(default_factory=dict)  # key -> slot
    key_of: dict[int, PageKey] = field(default_factory=dict)  # slot -> key
    checksum: dict[int, Checksum] = field(default_factory=dict)  # slot -> the page's checksums (``store.parts``)
    parent: dict[int, int] = field(default_factory=dict)  # slot -> slot of the page it chains on
    seq: int = 0
    generation: int = 0  # the generation a new writer journal should use
    checkpoint_generation: int = 0
    replayed_records: int = 0
    torn_journals: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # The checkpoint failed its checks: the index holds only what the journals since it say (pages it alone
    # listed are not indexed, though their slots still hold them).
    checkpoint_unreadable: bool = False
    cursor: tuple[int, int] = (0, 0)  # (generation, byte offset) just past the last record replayed
    touched: list[PageKey] = field(default_factory=list)  # TOUCH records replayed, not yet drained
    # Keys and slots a follower watches (pages it dropped): a PUT or DEL replayed since naming one removes it.
    watch: set[PageKey | int] = field(default_factory=set)
    checked_checkpoint: tuple[int, int] | None = None  # the announcement at which the checkpoint was last read
    parts: int = 1  # checksummed parts per page of the shard
    # Replay bookkeeping, settled by ``_settle_links``: parents named by key, and slots that changed hands.
    _pending_parent: dict[int, PageKey] = field(default_factory=dict)
    _reassigned: set[int] = field(default_factory=set)


def recover(meta: Path, parts: int = 1, *, view: FileView = POSIX,
            announced: Mapping[int, int] | None = None) -> Recovered:
    """Rebuild the index of the shard in ``meta`` (pages of ``parts`` checksummed parts): its checkpoint
    (if readable), then its journals in generation order, each up to its first torn or corrupt record
    (damage goes to ``problems``). ``announced`` (a cluster follower's): the journals only as far as
    ``follow_announced`` reads them (empty: the checkpoint alone)."""
    state = Recovered(parts=parts)
    ckpt = meta / CHECKPOINT
    raw = _read_or_none(view, ckpt)
    if raw is not None:
        try:
            _load_checkpoint(fmt.unpack_checkpoint(raw, str(ckpt)), state)
        except (CorruptRecordError, ValueError, KeyError, TypeError, IndexError) as exc:
            state = Recovered(problems=[f"checkpoint unreadable ({exc}); rebuilding from journals"], parts=parts,
                              checkpoint_unreadable=True)
            log.warning("%s: %s", ckpt, state.problems[-1])
    listed = journal_generations(meta, view)
    gens = [g for g in listed if g >= state.checkpoint_generation]
    state.cursor = (state.checkpoint_generation, 0)
    if announced is None:
        for gen in gens:
            state.cursor = (gen, _replay(journal_path(meta, gen), state, view=view))
    else:
        state.cursor = (min(gens, default=state.checkpoint_generation), 0)
        _walk(meta, state, announced, view)
    _settle_links(state)
    state.generation = max([state.checkpoint_generation - 1, *listed], default=0) + 1
    return state


def _read_or_none(view: FileView, path: Path) -> bytes | None:
    try:
        return view.read(path)
    except FileNotFoundError:
        return None


def _load_checkpoint(fields: dict[str, Any], state: Recovered) -> None:
    keys_blob: bytes = fields["keys"]
    n = len(keys_blob) // KEY_BYTES
    slots = np.frombuffer(fields["slots"], dtype=np.int64, count=n)
    parents = np.frombuffer(fields["parents"], dtype=np.int64, count=n)
    if n and (parents.max() >= n or slots.min() < 0):
        raise ValueError("checkpoint columns are inconsistent")
    keys = [PageKey(keys_blob[i:i + KEY_BYTES]) for i in range(0, n * KEY_BYTES, KEY_BYTES)]
    slot_list = slots.tolist()
    state.slot_of = dict(zip(keys, slot_list))
    state.key_of = dict(zip(slot_list, keys))
    blob: bytes = fields["checksums"]
    width = 8 * state.parts
    if len(blob) != n * width:
        raise ValueError(f"checkpoint has {len(blob) // 8} checksums for {n} pages of {state.parts} parts")
    sums: list[Checksum] = np.frombuffer(blob, dtype=np.uint64, count=n).tolist() if state.parts == 1 \
        else [blob[i:i + width] for i in range(0, n * width, width)]
    state.checksum = dict(zip(slot_list, sums))
    linked = parents >= 0
    state.parent = dict(zip(slots[linked].tolist(), slots[parents[linked]].tolist()))
    state.seq = fields["seq"]
    state.checkpoint_generation = fields["generation"]


def _forget(state: Recovered, key: PageKey) -> None:
    slot = state.slot_of.pop(key, None)
    if slot is not None and state.key_of.get(slot) == key:
        del state.key_of[slot]
        state.checksum.pop(slot, None)
        state.parent.pop(slot, None)
        state._pending_parent.pop(slot, None)
        state._reassigned.add(slot)


TOUCHED_LIMIT = 1 << 16  # touched keys kept undrained at most (the oldest go first: uses, not data)


def drain_touched(state: Recovered) -> list[PageKey]:
    """The keys of the TOUCH records replayed since the last drain (cleared here)."""
    keys, state.touched = state.touched, []
    return keys


def _apply(state: Recovered, rec: list[Any]) -> None:
    state.replayed_records += 1
    state.seq = max(state.seq, rec[1])
    key = PageKey(rec[2])
    if rec[0] == fmt.TOUCH:  # a use of another writer's page: never a change to this index
        state.touched.append(key)
        if len(state.touched) > TOUCHED_LIMIT:
            del state.touched[:len(state.touched) - TOUCHED_LIMIT]
        return
    if state.watch:
        state.watch.discard(key)
        if rec[0] == fmt.PUT:
            state.watch.discard(rec[3])
    _forget(state, key)
    if rec[0] != fmt.PUT:
        return
    slot, checksum = rec[3], rec[4]
    prev = state.key_of.get(slot)
    if prev is not None:
        _forget(state, prev)  # its bytes were overwritten by this page
    if type(checksum) is not int or state.parts != 1:  # a list: one checksum per part
        sums = [checksum] if isinstance(checksum, int) else checksum
        if len(sums) != state.parts:
            state.problems.append(f"PUT of {key.hex()[:16]} has {len(sums)} checksums, the shard's pages "
                                  f"have {state.parts} parts; not indexed")
            return
        checksum = pack_sums(sums)
    state.slot_of[key] = slot
    state.key_of[slot] = key
    state.checksum[slot] = checksum
    if rec[5] is not None:
        state._pending_parent[slot] = rec[5]


def _settle_links(state: Recovered) -> None:
    """Resolve replayed parent keys to slots; drop links to slots that changed hands during replay."""
    if state._reassigned:
        gone = state._reassigned
        state.parent = {c: p for c, p in state.parent.items() if p not in gone or c in state._pending_parent}
    for slot, parent_key in state._pending_parent.items():
        parent_slot = state.slot_of.get(parent_key)
        if parent_slot is not None and slot in state.key_of:
            state.parent[slot] = parent_slot
    state._pending_parent.clear()
    state._reassigned.clear()


def _replay(path: Path, state: Recovered, start: int = 0, view: FileView = POSIX) -> int:
    """Apply the records of one journal file from byte ``start``; returns the offset after the last good one."""
    try:
        return _replay_seen(path, state, start, view)[0]
    except FileNotFoundError:
        return start


def _replay_seen(path: Path, state: Recovered, start: int, view: FileView, stop: int | None = None) -> tuple[int, int]:
    """``_replay`` reading at most up to byte ``stop``: (the offset after the last good record, the offset
    where the bytes seen ended). Raises FileNotFoundError."""
    data = view.read(path, start, None if stop is None else max(0, stop - start))
    base, size = start, start + len(data)  # ``data`` holds the file's bytes from ``base`` on
    if start == 0:
        try:
            fmt.check_journal_file_header(data, str(path))
        except CorruptRecordError as exc:
            state.problems.append(str(exc))
            state.torn_journals.append(path.name)
            return 0, size
        start = fmt.JOURNAL_FILE_HEADER_BYTES
    end = start
    for after, rec in fmt.iter_records(data, start - base):
        _apply(state, rec)
        end = base + after
    if end != size:
        state.torn_journals.append(path.name)
        state.problems.append(f"{path.name}: torn or corrupt after byte {end} of {size}; the rest is ignored")
    return end, size


def follow(meta: Path, state: Recovered, view: FileView = POSIX) -> bool:
    """Bring a reader's ``state`` up to date with what a live writer appended since; True if anything changed.

    Cheap when nothing changed (a stat or two). If the writer checkpointed past journals this reader had
    not finished, the state is rebuilt from the new checkpoint. A record missed in a race can only make a
    page look absent or stale, and a stale slot fails its checksum on read: never wrong bytes.
    """
    gen, offset = state.cursor
    path = journal_path(meta, gen)
    try:
        size = view.size(path)
    except FileNotFoundError:
        size = -1
    newer = view.exists(journal_path(meta, gen + 1))
    if size == offset and not newer:
        return False
    if size < 0:  # the writer checkpointed and removed this journal: start over from its checkpoint
        state.__dict__.update(recover(meta, state.parts, view=view).__dict__)
        return True
    before, problems = state.replayed_records, len(state.problems)
    state.cursor = (gen, _replay(path, state, offset, view))
    while view.exists(journal_path(meta, state.cursor[0] + 1)):
        nxt = state.cursor[0] + 1
        state.cursor = (nxt, _replay(journal_path(meta, nxt), state, view=view))
    _settle_links(state)
    del state.problems[problems:]  # a live writer's tail is not damage
    state.torn_journals.clear()
    return state.replayed_records != before


def follow_announced(meta: Path, state: Recovered, announced: Mapping[int, int], view: FileView = POSIX) -> bool:
    """``follow`` for ``sharing = "cluster"``: only as far as ``announced`` (generation -> journal bytes the
    writer's leases announced; the highest generation is the writer's current one), by exact names (see the
    module docstring); True if anything changed. Nothing announced past the cursor: no file is read.
    """
    top = max(announced, default=-1)
    if top < 0 or state.cursor >= (top, announced[top]):
        return False
    before, problems = state.replayed_records, len(state.problems)
    fresh = None
    if not _walk(meta, state, announced, view) and state.checked_checkpoint != (top, announced[top]):
        # Stuck: a checkpoint past the cursor is a fresh start; none (or an older one, as this view may show
        # it) means lag, and the view stays as it is until the next announcement.
        state.checked_checkpoint = (top, announced[top])
        fresh = recover(meta, state.parts, view=view, announced=announced)
        if fresh.checkpoint_generation > state.cursor[0]:
            fresh.checked_checkpoint = state.checked_checkpoint
            state.__dict__.update(fresh.__dict__)
        else:
            fresh = None
    _settle_links(state)
    if fresh is None:
        del state.problems[problems:]  # a live writer's tail (or what this view sees of it) is not damage
    state.torn_journals.clear()
    return fresh is not None or state.replayed_records != before


def _walk(meta: Path, state: Recovered, announced: Mapping[int, int], view: FileView) -> bool:
    """Replay from ``state.cursor`` within ``announced``; False where it had to stop short (a journal not
    there, or a generation below the announced one torn, or short of what was announced of it)."""
    top = max(announced, default=-1)
    gen, offset = state.cursor
    while gen <= top:
        try:
            end, seen = _replay_seen(journal_path(meta, gen), state, offset, view,
                                     announced[top] if gen == top else None)
        except FileNotFoundError:
            return False
        state.cursor = (gen, end)
        if gen == top:
            return True  # a short tail here is resumed from the cursor next time
        if end != seen or end < announced.get(gen, 0):
            return False
        gen, offset = gen + 1, 0
    return True
