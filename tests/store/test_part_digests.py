"""Per-part checksums taken by the IO engine inside each page's IO (``IOOp.digest_ranges``), not by the
store after the batch: put (trailer and journal checksums from the engine's digests, the trailer in the
page's own IO) and get (each part verified by the engine's digest), with every engine, aligned and bounced
pages, parts that runs and O_DIRECT blocks cut anywhere; the one-part fast path as it was."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
import xxhash
from support import EngineWrapper, HostMemory, flip, key, namespace, slot_file, store_config

from sgl_kvtier.io import probe as probes
from sgl_kvtier.io.engine import IOOp, IOResult, OpKind
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.page_store import PageStore
from sgl_kvtier.store.parts import PartMap, pack_sums, sums_list
from sgl_kvtier.store.transfer import ReadVerdict

PAGE = 16384
N = 6
ALIGNED = (4096, 4096, 4096, 4096)
ODD = (3000, 5192, 4096, 4096)  # the first two not 4 KiB aligned
SPANNING = (6000, 6000, 4384)  # with 4 runs of 4 KiB per page, parts 0 and 1 each span two runs


def config(root: Path, parts: Sequence[int], **extra):
    extra.setdefault("capacity_bytes", 64 * fmt.slot_bytes_for(PAGE, len(parts)))
    return store_config(root, page_bytes=PAGE, **extra)


def ns(parts: Sequence[int]):
    return namespace(PAGE, parts=tuple(parts))


def expected_sums(page: bytes, parts: Sequence[int]) -> list[int]:
    pm = PartMap.of(parts)
    return [xxhash.xxh3_64_intdigest(page[a:a + n]) for a, n in zip(pm.offsets, pm.sizes)]


def trailer_sums(store: PageStore, k) -> list[int]:
    path, at = slot_file(store, k)
    with open(path, "rb") as f:
        f.seek(at + PAGE)
        trailer = fmt.unpack_trailer(f.read(store.slot_bytes - PAGE))
    assert trailer is not None
    return list(trailer.checksums)


class Recording(EngineWrapper):
    """Keeps every op and result it passed; ``strip`` drops ops' ranges and hooks (an engine that ignores them)."""

    def __init__(self, inner=None, strip: OpKind | None = None) -> None:
        super().__init__()
        if inner is not None:
            self.inner.close()
            self.inner = inner
        self.strip = strip
        self.seen: list[tuple[IOOp, IOResult]] = []

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        sent = [dataclasses.replace(op, digest_ranges=None, before_write=None) if op.kind is self.strip else op
                for op in ops]
        results = self.inner.run(sent)
        self.seen.extend(zip(ops, results))
        return results


@pytest.fixture(params=["threads", "uring"])
def engine_name(request) -> str:
    if request.param == "uring":
        verdict = probes.check("uring")
        if not verdict.available:
            pytest.skip(verdict.reason)
    return "auto" if request.param == "threads" else "uring"


@pytest.fixture
def no_caller_hashing(monkeypatch):
    """The store may not hash parts itself: the engine's digests must do."""
    def refuse(*args, **kwargs):
        raise AssertionError("parts hashed by the store, not the engine")

    monkeypatch.setattr(PartMap, "run_digests", refuse)
    monkeypatch.setattr(PartMap, "buffer_digests", refuse)


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("parts", [ALIGNED, ODD, SPANNING], ids=["aligned", "odd", "spanning"])
@pytest.mark.parametrize("mem_offset, direct", [(0, "auto"), (512, "auto"), (0, "off")],
                         ids=["direct", "bounced", "buffered"])
def test_put_and_get_round_trip_with_the_engines_part_digests(tmp_path, engine_name, parts, mem_offset, direct,
                                                              no_caller_hashing):
    mem = HostMemory(N, PAGE, runs_per_page=4, offset=mem_offset)
    expected = [mem.fill(i, 40 + i) for i in range(N)]
    keys = [key(i) for i in range(N)]
    cfg = config(tmp_path, parts, direct_io=direct, io_engine=engine_name)
    with open_writer(cfg, ns(parts)) as store:
        assert store.layout.direct == (direct == "auto")
        assert store.put(keys, [mem.runs(i) for i in range(N)]) == [True] * N
        for i, k in enumerate(keys):
            entry = store._index.lookup(k)
            assert entry is not None
            want = expected_sums(expected[i], parts)
            assert entry[1] == pack_sums(want)  # what the journal recorded...
            assert trailer_sums(store, k) == want  # ...is what the page's trailer carries
        mem.clear()
        assert store.get(keys, [mem.runs(i) for i in range(N)]) == [True] * N
        assert [mem.page(i).tobytes() for i in range(N)] == expected
        mem.clear()
        assert store.get_parts(keys, [mem.runs(i) for i in range(N)], lambda g, ok: None) == [True] * N
        assert [mem.page(i).tobytes() for i in range(N)] == expected
    with open_writer(cfg, ns(parts)) as store:  # recovered from the journal: the same checksums
        mem.clear()
        assert store.get(keys, [mem.runs(i) for i in range(N)]) == [True] * N
        assert [mem.page(i).tobytes() for i in range(N)] == expected


@pytest.mark.parametrize("parts", [ALIGNED, ODD, SPANNING], ids=["aligned", "odd", "spanning"])
@pytest.mark.parametrize("mem_offset", [0, 512], ids=["direct", "bounced"])
def test_a_bad_byte_in_part_k_fails_exactly_that_part(tmp_path, engine_name, parts, mem_offset, no_caller_hashing):
    mem = HostMemory(2, PAGE, runs_per_page=4, offset=mem_offset)
    page = mem.fill(0, 3)
    cfg = config(tmp_path, parts, io_engine=engine_name)
    with open_writer(cfg, ns(parts)) as store:
        assert store.put([key(0)], [mem.runs(0)]) == [True]
        entry = store._index.lookup(key(0))
        assert entry is not None
        recorded = sums_list(entry[1])
        assert recorded == expected_sums(page, parts)
        recording = Recording(store._io.engine)
        store._io.engine = recording
        pm = PartMap.of(parts)
        for k in range(pm.count):
            at = pm.offsets[k] + pm.sizes[k] // 2
            flip(store, key(0), at)
            recording.seen.clear()
            assert store._io.read([(mem.runs(1), entry)]) == [ReadVerdict.CORRUPT]
            ((_, res),) = recording.seen
            assert res.ok and res.part_digests is not None
            assert [a != b for a, b in zip(res.part_digests, recorded)] == [j == k for j in range(pm.count)], k
            flip(store, key(0), at)  # back as it was
        assert store._io.read([(mem.runs(1), entry)]) == [ReadVerdict.HIT]
        assert mem.page(1).tobytes() == page
        store._io.engine = recording.inner


# ------------------------------------------------------------------------------------------ one part
@pytest.mark.parametrize("mem_offset", [0, 512], ids=["direct", "bounced"])
def test_one_part_reads_keep_the_whole_op_digest_and_writes_seal_in_the_io(tmp_path, mem_offset):
    mem = HostMemory(N, PAGE, runs_per_page=4, offset=mem_offset)
    expected = [mem.fill(i, i) for i in range(N)]
    keys = [key(i) for i in range(N)]
    engine = Recording()
    with open_writer(config(tmp_path, (PAGE,)), namespace(PAGE), engine=engine) as store:
        assert store.put(keys, [mem.runs(i) for i in range(N)]) == [True] * N
        writes = [op for op, _ in engine.seen]
        assert all(op.digest_ranges == ((0, PAGE),) and op.before_write is not None for op in writes)
        for i, k in enumerate(keys):
            entry = store._index.lookup(k)
            assert entry is not None and entry[1] == xxhash.xxh3_64_intdigest(expected[i])  # an int, as before
            assert trailer_sums(store, k) == [entry[1]]
        engine.seen.clear()
        mem.clear()
        assert store.get(keys, [mem.runs(i) for i in range(N)]) == [True] * N
        assert [mem.page(i).tobytes() for i in range(N)] == expected
        reads = [op for op, _ in engine.seen]
        if mem_offset == 0:  # the fast path: the engine's digest of the whole op, no ranges
            assert all(op.checksum and op.digest_ranges is None for op in reads)
        else:  # bounced: the page's range of the (rounded up) bounce buffer
            assert all(not op.checksum and op.digest_ranges == ((0, PAGE),) for op in reads)


# ------------------------------------------------------------------------------------------ engines and faults
def test_an_engine_ignoring_the_ranges_keeps_no_page_and_reads_still_verify(tmp_path):
    mem = HostMemory(N, PAGE, runs_per_page=4)
    expected = [mem.fill(i, 9 + i) for i in range(N)]
    keys = [key(i) for i in range(N)]
    engine = Recording(strip=OpKind.WRITE)
    with open_writer(config(tmp_path, ODD), ns(ODD), engine=engine) as store:
        assert store.put(keys, [mem.runs(i) for i in range(N)]) == [False] * N  # no digests: no trailer
        assert len(store) == 0 and store.counters.io_errors == N
        engine.strip = OpKind.READ  # reads without ranges: the store hashes the parts after the batch
        assert store.put(keys, [mem.runs(i) for i in range(N)]) == [True] * N
        mem.clear()
        assert store.get(keys, [mem.runs(i) for i in range(N)]) == [True] * N
        assert [mem.page(i).tobytes() for i in range(N)] == expected
        flip(store, keys[2], PartMap.of(ODD).offsets[3] + 5)
        assert store.get(keys, [mem.runs(i) for i in range(N)]) == [True, True, False, True, True, True]


def test_torn_writes_with_parts_are_misses(tmp_path):
    mem = HostMemory(N, PAGE, runs_per_page=4)
    for i in range(N):
        mem.fill(i, i)
    keys = [key(i) for i in range(N)]
    cfg = config(tmp_path, ALIGNED, fault_injection={"seed": 1, "torn_write_rate": 1.0}, breaker_failures=100)
    with open_writer(cfg, ns(ALIGNED)) as store:
        assert store.put(keys, [mem.runs(i) for i in range(N)]) == [True] * N  # the device said "done"
        mem.clear()
        assert store.get(keys, [mem.runs(i) for i in range(N)]) == [False] * N  # half of each page is not there
        assert store.stats().counters["corrupt_pages"] == N
