"""Parts of a page: its checksummed byte ranges (``store.format``, "Parts"), so reads verify layer group by
layer group. Pure helpers, no IO.

A namespace's ``parts`` (``Namespace.part_sizes()``) lists each range's byte length, in page order; they add
up to the page (default: one part, the whole page). Each part has its own xxh3-64, taken at write time
(the slot trailer and the PUT record carry them all, the checkpoint ``n * parts`` of them) and checked on
every read: a page is a hit only if all its parts pass.

A ``Checksum`` in memory (the index, ``store.transfer.ReadItem``) is the page's xxh3-64 as an int when the shard
has one part, else every part's u64 packed little-endian into ``8 * parts`` bytes (a row of the
checkpoint's column). ``PartMap.split`` cuts a page's caller runs at the parts' boundaries. Groups
(``PartMap.plan``): a group-major read (``store.part_reads``) reads and verifies the parts in groups that
cover every part exactly once (default: one per part, in order); e.g. a ``layer_first`` page with G layer
groups has 2G parts (G K ranges, then G V ranges), read as ``[[g, G + g] for g in range(G)]``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

import xxhash

from sgl_kvtier.io.buffers import Run, view
from sgl_kvtier.io.engine import digest

Checksum = int | bytes  # one part: its xxh3-64; several: their u64s packed little-endian


def pack_sums(sums: Sequence[int]) -> Checksum:
    """The in-memory ``Checksum`` of a page's part checksums (one part: the int itself)."""
    return sums[0] if len(sums) == 1 else struct.pack(f"<{len(sums)}Q", *sums)


def sums_list(checksum: Checksum) -> list[int]:
    """Every part's checksum of a ``Checksum``, in order (what a PUT record and a trailer carry)."""
    if isinstance(checksum, int):
        return [checksum]
    return list(struct.unpack(f"<{len(checksum) // 8}Q", checksum))


def sums_count(checksum: Checksum) -> int:
    """How many parts a ``Checksum`` covers."""
    return 1 if isinstance(checksum, int) else len(checksum) // 8


def part_sum(checksum: Checksum, part: int) -> int:
    """The checksum of part ``part`` recorded in ``checksum``."""
    if isinstance(checksum, int):
        return checksum if part == 0 else -1  # -1 matches no digest
    return int(struct.unpack_from("<Q", checksum, 8 * part)[0])


@dataclass(frozen=True)
class PartMap:
    """The parts of one shard's pages: each part's size and its offset in the page."""

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, sizes: Sequence[int]) -> PartMap:
        """The map of parts of these sizes (positive, at least one)."""
        if not sizes or any(s <= 0 for s in sizes):
            raise ValueError(f"parts must be positive byte lengths, got {list(sizes)}")
        return cls(tuple(sizes), tuple(accumulate(sizes[:-1], initial=0)))

    @property
    def count(self) -> int:
        return len(self.sizes)

    @property
    def page_bytes(self) -> int:
        return self.offsets[-1] + self.sizes[-1]

    def split(self, runs: Sequence[Run]) -> list[list[Run]]:
        """A page's runs cut at the parts' boundaries: per part, the runs covering its bytes, in order.

        Where each cut falls depends only on the runs' lengths, the same for every page of a pool: it is
        worked out once per shape (``_cuts``) and applied to each page's addresses.
        Raises ValueError when the runs hold more bytes than a page (fewer leave the last parts short)."""
        cuts = _cuts(self.sizes, tuple(n for _, n in runs))
        return [[(runs[i][0] + at, n) for i, at, n in part] for part in cuts]

    def run_digests(self, runs: Sequence[Run]) -> list[int]:
        """Each part's xxh3-64 over a page held in caller memory as ``runs``."""
        return [digest([view(a, n) for a, n in piece]) for piece in self.split(runs)]

    def buffer_digests(self, buf: memoryview) -> list[int]:
        """Each part's xxh3-64 over a page held contiguously at the start of ``buf``."""
        return [xxhash.xxh3_64_intdigest(buf[at:at + size]) for at, size in zip(self.offsets, self.sizes)]

    def plan(self, groups: Sequence[Sequence[int]] | None = None) -> list[tuple[int, ...]]:
        """The groups of a group-major read (module docstring): ``groups`` checked to cover every part
        exactly once, or one group per part. Raises ValueError otherwise."""
        if groups is None:
            return [(p,) for p in range(self.count)]
        plan = [tuple(int(p) for p in g) for g in groups]
        flat = sorted(p for g in plan for p in g)
        if flat != list(range(self.count)) or not all(plan):
            raise ValueError(f"groups {[list(g) for g in plan]} must cover the {self.count} parts "
                             f"(0..{self.count - 1}) exactly once, none empty")
        return plan


@lru_cache(maxsize=64)
def _cuts(sizes: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per part, its pieces as ``(run index, offset in the run, bytes)``, for runs of these ``lengths``."""
    out: list[list[tuple[int, int, int]]] = [[] for _ in sizes]
    part, left = 0, sizes[0]
    for i, length in enumerate(lengths):
        at = 0
        while length > 0:
            if left == 0:
                raise ValueError(f"page runs hold more than the page's {sum(sizes)} bytes")
            take = min(length, left)
            out[part].append((i, at, take))
            at, length, left = at + take, length - take, left - take
            if left == 0 and part + 1 < len(sizes):
                part += 1
                left = sizes[part]
    return tuple(tuple(p) for p in out)

