"""The writer's lease (``sharing.lease``): A/B blocks, torn beats, the beat thread's lifecycle. Beats are
called directly; no test waits for the thread."""

from __future__ import annotations

import threading

from support import HostMemory, key, open_store

from sgl_kvtier.sharing.lease import THREAD_NAME, Lease, read_lease
from sgl_kvtier.store import format as fmt


def make(tmp_path, usage=None, clock=None) -> Lease:
    times = iter(range(1000))
    return Lease(tmp_path / "LEASE", {"wid": "h-0", "pid": 1, "incarnation": b"i" * 16},
                 usage or (lambda: {"pages": 3}), 0.5, clock=clock or (lambda: float(next(times))))


def test_beats_alternate_blocks_and_the_newest_counter_wins(tmp_path):
    lease = make(tmp_path)
    assert read_lease(tmp_path / "LEASE") is None  # created, never beaten: no valid block yet
    lease.beat()
    lease.beat()
    lease.beat()
    got = read_lease(tmp_path / "LEASE")
    assert got is not None and got["counter"] == 2 and got["pages"] == 3 and got["heartbeat_s"] == 0.5
    assert got["wid"] == "h-0" and got["incarnation"] == b"i" * 16
    assert lease.last_beat == 2.0  # the injected clock's third reading
    lease.close()


def test_a_lease_reopened_in_place_wins_from_its_first_beat(tmp_path):
    """A writer restarted into its own directory: its first beat is the lease readers see, not the previous
    incarnation's last block (which a retirer that judged it dead would otherwise find unchanged)."""
    old = make(tmp_path)
    for _ in range(4):
        old.beat()  # counters 0..3: block A holds 2, block B holds 3
    old.close()
    again = Lease(tmp_path / "LEASE", {"wid": "h-0", "pid": 2, "incarnation": b"j" * 16}, lambda: {"pages": 0}, 0.5)
    assert again.counter == 4
    again.beat()  # block A: 4, over the old 2; block B keeps the old 3
    got = read_lease(tmp_path / "LEASE")
    assert got is not None and got["incarnation"] == b"j" * 16 and got["counter"] == 4 and got["pid"] == 2
    again.close()


def test_a_torn_beat_leaves_the_previous_lease(tmp_path):
    lease = make(tmp_path)
    lease.beat()  # counter 0 in block A
    lease.beat()  # counter 1 in block B
    lease.close()
    path = tmp_path / "LEASE"
    data = bytearray(path.read_bytes())
    data[fmt.LEASE_BLOCK_BYTES + 30] ^= 0xFF  # block B torn
    path.write_bytes(bytes(data))
    got = read_lease(path)
    assert got is not None and got["counter"] == 0
    path.write_bytes(b"\0" * 100)
    assert read_lease(path) is None and read_lease(tmp_path / "absent") is None


def test_a_failing_beat_never_raises_from_the_thread(tmp_path):
    def broken() -> dict:
        raise OSError(5, "EIO")

    lease = make(tmp_path, usage=broken)
    lease._safe_beat()  # what the thread runs
    assert lease.failures == 1 and lease.counter == 0
    lease.close()
    lease.close()  # idempotent


def test_the_store_beats_on_its_thread_and_stops_it_at_close(tmp_path):
    mem = HostMemory(2)
    before = {t for t in threading.enumerate() if t.name == THREAD_NAME}  # other tests' open stores, if any
    store = open_store(tmp_path, heartbeat_s=600.0)  # the thread never beats on its own during the test
    mine = {t for t in threading.enumerate() if t.name == THREAD_NAME} - before
    assert len(mine) == 1
    mem.fill(0, 1)
    assert store.put([key(1)], [mem.runs(0)]) == [True]
    assert store.lease is not None
    store.lease.beat()
    got = read_lease(store.layout.meta / "LEASE")
    assert got is not None and got["pages"] == 1 and got["bytes_used"] == store.slot_bytes
    assert got["capacity_bytes"] == store.stats().capacity_bytes and got["age_hist"] == [store.slot_bytes]  # one page, age bucket 0
    gen, size = got["journal"]
    assert gen == store._journal.generation and size == store._journal.path.stat().st_size
    store.close()
    assert not any(t.is_alive() for t in mine)
