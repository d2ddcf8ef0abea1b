"""The log of a recorded run and the crash-state builder (the model is the package docstring's).

``build(recording, cut, policy, rng)`` replays the initial snapshot and the log entries ``[0, cut)``,
keeping what was made durable by a completed sync and resolving the rest by ``policy``; it returns the
surviving tree as ``{relative path: bytes, or None for a directory}``. ``materialize`` writes such a
tree into a fresh directory. ``stratified_cuts`` picks cut positions spread over every kind of
operation the log holds (the entry just before the cut: a segment write, a journal fsync, a rename of
``checkpoint.bin.tmp``, ...), so a few dozen cuts cover every write path of a workload.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
from pathlib import Path
from typing import Any

DATA_POLICIES = ("drop", "keep", "torn", "reorder")
NAMESPACE_POLICIES = ("drop", "keep", "prefix")
GRANULARITIES = (512, 4096)
Tree = dict[str, bytes | None]


@dataclasses.dataclass
class Entry:
    """One logged operation. ``kind``: write / trunc / alloc (data of ``node``), add / del / move (an
    entry ``name`` of directory ``parent``; ``old``: a move's former name), sync (of ``node``; ``is_dir``),
    syncall, mark (``label``, ``payload``: the workload's)."""

    kind: str
    node: int = -1
    parent: int = -1
    name: str = ""
    old: str = ""
    path: str = ""
    offset: int = 0
    data: bytes = b""
    size: int = 0
    durable: bool = False  # an O_DIRECT write to a device with power-loss protection
    is_dir: bool = False
    label: str = ""
    payload: Any = None


@dataclasses.dataclass
class Recording:
    """What a ``Recorder`` saw: the durable start (snapshot) and the log."""

    root: str
    root_node: int = 0
    initial_entries: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)  # dir -> name -> node
    initial_data: dict[int, bytes] = dataclasses.field(default_factory=dict)  # file node -> bytes
    dirs: set[int] = dataclasses.field(default_factory=set)
    entries: list[Entry] = dataclasses.field(default_factory=list)
    adopted: int = 0  # paths met that the log never saw made (taken as durable)

    def marks(self, cut: int | None = None) -> list[tuple[int, Entry]]:
        """``(position, entry)`` of the workload marks before ``cut`` (all of them: None)."""
        end = len(self.entries) if cut is None else cut
        return [(i, e) for i, e in enumerate(self.entries[:end]) if e.kind == "mark"]

    def op_class(self, position: int) -> str:
        """The kind of operation at ``position``: its kind and its file's name pattern (digits and hex ids
        replaced by ``#``), e.g. ``write seg-#.dat``, ``fsync journal-#.log``, ``move checkpoint.bin``."""
        e = self.entries[position]
        name = re.sub(r"[0-9a-f]{8,}|\d+", "#", os.path.basename(e.path)) if e.path else ""
        kind = e.name if e.kind == "sync" else e.kind
        return f"{kind}{' dir' if e.is_dir else ''} {name}".strip()


@dataclasses.dataclass(frozen=True)
class CutPolicy:
    """How what was not durable at the cut is resolved (see the package docstring)."""

    data: str = "drop"  # drop | keep | torn | reorder
    namespace: str = "drop"  # drop | keep | prefix
    granularity: int = 4096  # torn writes land in chunks of this many bytes (aligned in the file)

    def __post_init__(self) -> None:
        if self.data not in DATA_POLICIES or self.namespace not in NAMESPACE_POLICIES or self.granularity < 1:
            raise ValueError(f"CutPolicy: data in {DATA_POLICIES}, namespace in {NAMESPACE_POLICIES}, "
                             f"granularity > 0; got {self}")

    def __str__(self) -> str:
        return f"{self.data}/{self.namespace}/{self.granularity}"


def random_policy(rng: random.Random) -> CutPolicy:
    """A policy drawn from ``rng``: any data and namespace policy, 512 B or 4 KiB tearing."""
    return CutPolicy(rng.choice(DATA_POLICIES), rng.choice(NAMESPACE_POLICIES), rng.choice(GRANULARITIES))


def _apply_data(data: dict[int, bytearray], e: Entry) -> None:
    buf = data.setdefault(e.node, bytearray())
    if e.kind == "write":
        end = e.offset + len(e.data)
        if len(buf) < end:
            buf.extend(bytes(end - len(buf)))
        buf[e.offset:end] = e.data
    elif e.kind == "trunc":
        if len(buf) > e.size:
            del buf[e.size:]
        else:
            buf.extend(bytes(e.size - len(buf)))
    elif e.kind == "alloc" and len(buf) < e.size:
        buf.extend(bytes(e.size - len(buf)))


def _torn(e: Entry, granularity: int, rng: random.Random) -> list[Entry]:
    """The parts of a write that land when it tears: a random subset of its aligned chunks."""
    if e.kind != "write":
        return [e] if rng.random() < 0.5 else []
    parts, at, end = [], e.offset, e.offset + len(e.data)
    while at < end:
        nxt = min(end, (at // granularity + 1) * granularity)
        if rng.random() < 0.5:
            parts.append(dataclasses.replace(e, offset=at, data=e.data[at - e.offset:nxt - e.offset]))
        at = nxt
    return parts


def _apply_ns(entries: dict[int, dict[str, int]], e: Entry) -> None:
    table = entries.setdefault(e.parent, {})
    if e.kind == "add":
        table[e.name] = e.node
    elif e.kind == "del":
        table.pop(e.name, None)
    elif e.kind == "move":
        node = table.pop(e.old, None)
        table[e.name] = e.node if node is None else node


def build(recording: Recording, cut: int, policy: CutPolicy, rng: random.Random) -> Tree:
    """The tree a power cut before log position ``cut`` leaves under ``policy`` (see the module docstring)."""
    if not 0 <= cut <= len(recording.entries):
        raise ValueError(f"cut {cut} outside [0, {len(recording.entries)}]")
    data = {n: bytearray(b) for n, b in recording.initial_data.items()}
    entries = {d: dict(t) for d, t in recording.initial_entries.items()}
    pending_data: dict[int, list[Entry]] = {}
    pending_ns: list[Entry] = []
    for e in recording.entries[:cut]:
        if e.kind in ("write", "trunc", "alloc"):
            if e.durable:
                _apply_data(data, e)
            else:
                pending_data.setdefault(e.node, []).append(e)
        elif e.kind in ("add", "del", "move"):
            pending_ns.append(e)
        elif e.kind == "sync" and e.is_dir:
            for p in [p for p in pending_ns if p.parent == e.node]:
                _apply_ns(entries, p)
            pending_ns = [p for p in pending_ns if p.parent != e.node]
        elif e.kind == "sync":
            for p in pending_data.pop(e.node, []):
                _apply_data(data, p)
        elif e.kind == "syncall":
            for ops in pending_data.values():
                for p in ops:
                    _apply_data(data, p)
            for p in pending_ns:
                _apply_ns(entries, p)
            pending_data, pending_ns = {}, []
    for node in sorted(pending_data):
        for p in pending_data[node]:
            if policy.data == "keep" or (policy.data == "reorder" and rng.random() < 0.5):
                _apply_data(data, p)
            elif policy.data == "torn":
                for part in _torn(p, policy.granularity, rng):
                    _apply_data(data, part)
    kept = {"drop": 0, "keep": len(pending_ns), "prefix": rng.randint(0, len(pending_ns))}[policy.namespace]
    for p in pending_ns[:kept]:
        _apply_ns(entries, p)
    tree: Tree = {}
    _walk(recording, entries, data, recording.root_node, "", tree, set())
    return tree


def _walk(rec: Recording, entries: dict[int, dict[str, int]], data: dict[int, bytearray], node: int, rel: str,
          tree: Tree, seen: set[int]) -> None:
    seen.add(node)
    for name, child in sorted(entries.get(node, {}).items()):
        path = f"{rel}/{name}" if rel else name
        if child in rec.dirs:
            if child not in seen:
                tree[path] = None
                _walk(rec, entries, data, child, path, tree, seen)
        else:
            tree[path] = bytes(data.get(child, b""))


def materialize(tree: Tree, dest: Path | str) -> Path:
    """Write ``tree`` under ``dest`` (made if missing; must be empty): directories 0700, files 0600."""
    root = Path(dest)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    for rel, content in sorted(tree.items()):
        path = root / rel
        if content is None:
            path.mkdir(mode=0o700, exist_ok=True)
        else:
            path.write_bytes(content)
            path.chmod(0o600)
    return root


def stratified_cuts(recording: Recording, n: int, rng: random.Random) -> list[int]:
    """``n`` cut positions (sorted, distinct where the log allows), taken round-robin over the operation
    classes (``Recording.op_class`` of the entry just before the cut), each class's positions in random
    order; the cut before everything and the one after everything come first."""
    total = len(recording.entries)
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(recording.entries):
        if e.kind != "mark":
            groups.setdefault(recording.op_class(i), []).append(i + 1)
    for positions in groups.values():
        rng.shuffle(positions)
    chosen: list[int] = [total, 0][:n]
    order = sorted(groups)
    while len(chosen) < min(n, total + 1) and any(groups.values()):
        for cls in order:
            if groups[cls] and len(chosen) < n:
                pos = groups[cls].pop()
                if pos not in chosen:
                    chosen.append(pos)
    return sorted(chosen)
