"""PageIO: read verdicts (a hit, a corrupt page, a failed IO, a device whose circuit is open, per page) and
the slot trailer written with every page, on the aligned, bounce and buffered paths."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import xxhash
from support import EngineWrapper, HostMemory, key, namespace, store_config

from sgl_kvtier.io.engine import IOOp, IOResult
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.transfer import ReadVerdict


class FailingSlot(EngineWrapper):
    """The op at ``where`` (fd, byte offset) fails with EIO."""

    where: tuple[int, int] | None = None

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        results = self.inner.run(ops)
        return [IOResult(error=OSError(5, "injected EIO")) if (op.fd, op.offset) == self.where else res
                for op, res in zip(ops, results)]


def test_each_page_gets_its_own_verdict(tmp_path):
    devs = [tmp_path / "d0", tmp_path / "d1"]
    for d in devs:
        d.mkdir()
    mem = HostMemory(4)
    expected = [mem.fill(i, i) for i in range(4)]
    engine = FailingSlot()
    with open_writer(store_config(tmp_path, devices=devs), namespace(), engine=engine) as store:
        keys = [key(i) for i in range(4)]
        assert store.put(keys, [mem.runs(i) for i in range(4)]) == [True] * 4
        entries = [store._index.lookup(k) for k in keys]
        assert [slot % 2 for slot, _ in entries] == [0, 1, 0, 1]  # striped over the two devices
        engine.where = store.layout.arenas[0].locate(entries[2][0] // 2)  # page 2's IO fails
        entries[1] = (entries[1][0], entries[1][1] ^ 1)  # page 1's recorded checksum is wrong: corrupt
        mem.clear()
        io = store._io
        assert io.read([(mem.runs(i), e) for i, e in enumerate(entries)]) == [
            ReadVerdict.HIT, ReadVerdict.CORRUPT, ReadVerdict.IO_ERROR, ReadVerdict.HIT]
        assert mem.page(0).tobytes() == expected[0] and mem.page(3).tobytes() == expected[3]
        for _ in range(store.config.breaker_failures):
            store.health.record(1, ok=False)  # device 1's circuit opens: its pages are not even read
        assert io.read([(mem.runs(i), e) for i, e in enumerate(entries)]) == [
            ReadVerdict.HIT, ReadVerdict.SKIPPED, ReadVerdict.IO_ERROR, ReadVerdict.SKIPPED]


def test_concurrent_batches_of_bounced_pages_never_wait_for_each_other(tmp_path):
    """Pages that need bounce buffers (3 KiB: not O_DIRECT-aligned) read by two threads at once, each batch as
    large as the pool: a batch takes its buffers together, so neither holds part of the pool waiting for the
    rest (taking them one by one deadlocked here on every run)."""
    import threading

    page = 3072
    store = open_writer(store_config(tmp_path, 64, page, io_depth=8), namespace(page))
    with store:
        mem = HostMemory(16, page_bytes=page)
        keys = [key(i) for i in range(16)]
        want = [mem.fill(i, i) for i in range(16)]
        assert store.put(keys, [mem.runs(i) for i in range(16)]) == [True] * 16
        got: list[list[bool]] = [[], []]

        def reader(n: int) -> None:
            lo = 8 * n
            for _ in range(200):
                got[n].append(all(store.get(keys[lo:lo + 8], [mem.runs(i) for i in range(lo, lo + 8)])))

        threads = [threading.Thread(target=reader, args=(n,), daemon=True) for n in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "bounce-buffer deadlock"
        assert got == [[True] * 200, [True] * 200]
        assert [bytes(mem.page(i)) for i in range(16)] == want


# ------------------------------------------------------------------------------------ slot trailers
def raw_slot(store, slot: int) -> bytes:
    """The whole slot as on disk (an aligned read: the arena's descriptor may be O_DIRECT)."""
    import os

    from sgl_kvtier.io.buffers import AlignedBuffer

    n = len(store.layout.arenas)
    fd, offset = store.layout.arenas[slot % n].locate(slot // n)
    buf = AlignedBuffer(store.slot_bytes)
    try:
        assert os.preadv(fd, [buf.view[:store.slot_bytes]], offset) == store.slot_bytes
        return bytes(buf.view[:store.slot_bytes])
    finally:
        buf.close()


@pytest.mark.parametrize("page, mem_offset, direct", [
    (16384, 0, "auto"),  # aligned runs: the page's runs + one aligned tail buffer
    (16384, 512, "auto"),  # unaligned runs: the bounce path
    (3072, 0, "auto"),  # a page that is no multiple of 4 KiB: the bounce path
    (16384, 0, "off"),  # buffered IO: the runs + the tail, unaligned is fine
], ids=["aligned", "unaligned-runs", "odd-page", "buffered"])
def test_every_page_write_carries_its_trailer(tmp_path, page, mem_offset, direct):
    devs = [tmp_path / "d0", tmp_path / "d1"]
    for d in devs:
        d.mkdir()
    mem = HostMemory(6, page_bytes=page, offset=mem_offset)
    want = [mem.fill(i, 40 + i) for i in range(6)]
    keys = [key(i) for i in range(6)]
    ns = namespace(page)
    with open_writer(store_config(tmp_path, 64, page, devices=devs, direct_io=direct), ns) as store:
        assert store.slot_bytes == fmt.slot_bytes_for(page)
        if direct == "auto":
            assert store.layout.direct
        assert store.put(keys[:4], [mem.runs(i) for i in range(4)], parent=key(99)) == [True] * 4
        assert store.put(keys[4:], [mem.runs(i) for i in range(4, 6)]) == [True] * 2
        seqs = []
        for i, k in enumerate(keys):
            raw = raw_slot(store, store.slot_of(k))
            assert raw[:page] == want[i]
            t = fmt.unpack_trailer(raw[page:])
            assert t is not None and t.ns_digest == ns.digest() and t.key == k
            assert t.incarnation == store.incarnation
            assert t.parent == {0: key(99), 4: None}.get(i, keys[i - 1])  # each batch chains on
            assert t.checksums == (xxhash.xxh3_64_intdigest(want[i]),)
            assert t.checksums[0] == store._index.lookup(k)[1]  # the trailer's checksum is the index's
            assert raw[page + fmt.trailer_bytes(1):] == bytes(store.slot_bytes - page - fmt.trailer_bytes(1))
            seqs.append(t.seq)
        assert seqs == sorted(seqs) and len(set(seqs)) == 6  # one seq per write, increasing
        mem.clear()
        assert store.get(keys, [mem.runs(i) for i in range(6)]) == [True] * 6
        assert [mem.page(i).tobytes() for i in range(6)] == want


def test_a_reader_cannot_write_and_a_slot_without_room_for_a_trailer_is_refused(tmp_path):
    import dataclasses

    from sgl_kvtier.errors import KVTierError, StoreFormatError
    from sgl_kvtier.sharing.follower import PageReader
    from sgl_kvtier.store.transfer import PageIO, SlotIdentity

    mem = HostMemory(1)
    mem.fill(0, 1)
    cfg = store_config(tmp_path)
    with open_writer(cfg, namespace()) as store:
        store.put([key(0)], [mem.runs(0)])
        with PageReader.open(cfg, namespace()) as reader:
            with pytest.raises(KVTierError, match="no writer identity"):
                reader._io.write([(mem.runs(0), 1, key(1), None, 1)])
        cramped = dataclasses.replace(store.layout, slot_bytes=store.page_bytes)  # a format-1 sized slot
        with pytest.raises(StoreFormatError, match="trailer"):
            PageIO(cramped, store._engine, store.health, store.counters, store.page_bytes, 4, False,
                   lambda slot: None, identity=SlotIdentity(bytes(16), bytes(16)))
