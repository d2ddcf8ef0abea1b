"""PageIO's read verdicts: a hit, a corrupt page, a failed IO and a device whose circuit is open, per page."""

from __future__ import annotations

from collections.abc import Sequence

from support import EngineWrapper, HostMemory, key, namespace, store_config

from sgl_kvtier.io.engine import IOOp, IOResult
from sgl_kvtier.store.page_store import PageStore
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
    with PageStore.open(store_config(tmp_path, devices=devs), namespace(), engine=engine) as store:
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
    store = PageStore.open(store_config(tmp_path, 64, page, io_depth=8), namespace(page))
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
