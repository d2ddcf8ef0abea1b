"""PageStore behaviour: round trips, prefixes, skips, bad input, capacity, concurrency, restart."""

from __future__ import annotations

import os
import stat
import subprocess

import numpy as np
import pytest
from support import PAGE_BYTES, HostMemory, key, namespace, open_store, run_concurrently

from sgl_kvtier.config import Durability
from sgl_kvtier.errors import DeviceError, StoreLockedError


def put_range(store, mem, first, count, slot0=0, seed0=0):
    expected = {}
    for j in range(count):
        expected[key(first + j)] = mem.fill(slot0 + j, seed0 + first + j)
    ok = store.put([key(first + j) for j in range(count)], [mem.runs(slot0 + j) for j in range(count)])
    return ok, expected


def test_round_trip_into_scattered_slots(tmp_path):
    mem = HostMemory(64)
    with open_store(tmp_path) as store:
        ok, expected = put_range(store, mem, 0, 32)
        assert ok == [True] * 32
        mem.clear()
        targets = list(np.random.default_rng(1).permutation(64)[:32])  # scatter into other host slots
        got = store.get(list(expected), [mem.runs(t) for t in targets])
        assert got == [True] * 32
        for data, t in zip(expected.values(), targets):
            assert mem.page(t).tobytes() == data


def test_unaligned_runs_go_through_bounce_buffers(tmp_path):
    aligned, odd = HostMemory(8), HostMemory(8, offset=512)
    with open_store(tmp_path) as store:
        _, expected = put_range(store, odd, 0, 8)
        assert store.get(list(expected), [aligned.runs(i) for i in range(8)]) == [True] * 8
        assert [aligned.page(i).tobytes() for i in range(8)] == list(expected.values())
        odd.clear()
        assert store.get(list(expected), [odd.runs(i) for i in range(8)]) == [True] * 8
        assert [odd.page(i).tobytes() for i in range(8)] == list(expected.values())


def test_page_size_not_a_multiple_of_4k(tmp_path):
    page = 70_272  # a DeepSeek MLA page with page_size 1
    mem = HostMemory(4, page_bytes=page, runs_per_page=1)
    with open_store(tmp_path, page_bytes=page) as store:
        _, expected = put_range(store, mem, 0, 4)
        mem.clear()
        assert store.get(list(expected), [mem.runs(i) for i in range(4)]) == [True] * 4
        assert [mem.page(i).tobytes() for i in range(4)] == list(expected.values())


def test_layer_first_many_runs(tmp_path):
    mem = HostMemory(4, runs_per_page=8)  # 2 x 4 layers
    with open_store(tmp_path) as store:
        _, expected = put_range(store, mem, 0, 4)
        mem.clear()
        assert store.get(list(expected), [mem.runs(i) for i in range(4)]) == [True] * 4
        assert mem.page(3).tobytes() == expected[key(3)]


def test_longest_prefix_and_partial_gets(tmp_path):
    mem = HostMemory(16)
    with open_store(tmp_path) as store:
        put_range(store, mem, 0, 5)
        assert store.longest_prefix([key(i) for i in range(8)]) == 5
        assert store.longest_prefix([key(9), key(0)]) == 0
        assert store.longest_prefix([]) == 0
        got = store.get([key(0), key(9), key(2)], [mem.runs(i) for i in range(3)])
        assert got == [True, False, True]


def test_existing_keys_are_skipped_not_rewritten(tmp_path):
    mem = HostMemory(8)
    with open_store(tmp_path) as store:
        put_range(store, mem, 0, 4)
        before = store.stats().counters["put_pages"]
        ok, _ = put_range(store, mem, 0, 4, seed0=100)  # same keys, other bytes
        assert ok == [True] * 4
        assert store.stats().counters["put_pages"] == before
        assert store.stats().counters["put_present"] == 4
        dup = store.put([key(7), key(7)], [mem.runs(0), mem.runs(1)])
        assert dup == [True, True] and store.stats().counters["put_pages"] == before + 1


def test_wrong_page_size_and_bad_keys_are_rejected_per_page(tmp_path):
    mem = HostMemory(4)
    with open_store(tmp_path) as store:
        short = [(mem.buffer.address, PAGE_BYTES // 2)]
        ok = store.put([key(0), key(1), b"short", key(3)], [short, mem.runs(1), mem.runs(2), mem.runs(3)])
        assert ok == [False, True, False, True]
        assert store.longest_prefix([key(1), key(3)]) == 2
        assert not store.contains(key(0))
        assert store.get([key(1)], [short]) == [False]
        assert store.stats().counters["bad_requests"] == 3


def test_capacity_is_respected_with_lru_eviction(tmp_path):
    mem = HostMemory(8)
    with open_store(tmp_path, capacity_pages=8, eviction="lru") as store:
        put_range(store, mem, 0, 8)
        store.get([key(0)], [mem.runs(0)])  # key 0 is now the most recent
        ok, _ = put_range(store, mem, 100, 2)
        assert ok == [True, True]
        assert len(store) == 8
        assert store.contains(key(0)) and not store.contains(key(1)) and not store.contains(key(2))
        assert store.stats().counters["evictions"] == 2
        assert store.stats().bytes_used <= store.stats().capacity_bytes


def test_chain_eviction_takes_deepest_pages_first(tmp_path):
    mem = HostMemory(8)
    with open_store(tmp_path, capacity_pages=8, eviction="chain") as store:
        put_range(store, mem, 0, 4)  # chain a: 0 <- 1 <- 2 <- 3
        put_range(store, mem, 10, 4)  # chain b: 10 <- ... <- 13
        store.get([key(0), key(1)], [mem.runs(0), mem.runs(1)])  # heads of chain a are hot
        put_range(store, mem, 20, 3)
        # Victims are leaves only: chain a's tail goes first (its tail is colder than b's), deepest first.
        assert [store.contains(key(i)) for i in (0, 1, 2, 3)] == [True, True, False, False]
        assert [store.contains(key(i)) for i in (10, 11, 12, 13)] == [True, True, True, False]
        assert store.longest_prefix([key(i) for i in range(4)]) == 2


def test_chain_parent_links_across_batches(tmp_path):
    mem = HostMemory(8)
    with open_store(tmp_path, capacity_pages=4, eviction="chain") as store:
        store.put([key(0), key(1)], [mem.runs(0), mem.runs(1)])
        store.put([key(2), key(3)], [mem.runs(2), mem.runs(3)], parent=key(1))
        store.get([key(3)], [mem.runs(3)])  # touching the leaf does not save its ancestors' order...
        store.put([key(9)], [mem.runs(4)])
        # ...but key(3) is the only leaf of the chain: it must go before any ancestor does.
        assert not store.contains(key(3)) and store.longest_prefix([key(i) for i in range(4)]) == 3


def test_admission_threshold(tmp_path):
    mem = HostMemory(2)
    with open_store(tmp_path, admission_threshold=2) as store:
        assert store.put([key(0)], [mem.runs(0)]) == [True]
        assert not store.contains(key(0)) and store.stats().counters["put_declined"] == 1
        assert store.put([key(0)], [mem.runs(0)]) == [True]
        assert store.contains(key(0))


def test_warm_restart_serves_everything(tmp_path):
    mem = HostMemory(32)
    with open_store(tmp_path) as store:
        _, expected = put_range(store, mem, 0, 32)
    mem.clear()
    with open_store(tmp_path) as store:
        assert len(store) == 32
        assert store.get(list(expected), [mem.runs(i) for i in range(32)]) == [True] * 32
        assert [mem.page(i).tobytes() for i in range(32)] == list(expected.values())


def test_restart_without_close_replays_journal(tmp_path):
    mem = HostMemory(8)
    store = open_store(tmp_path)
    _, expected = put_range(store, mem, 0, 8)
    store.delete([key(3)])
    # Simulate the process dying: no checkpoint, its lease thread gone, its lock released by the kernel.
    store._close_lease()
    store.claim.release()
    with open_store(tmp_path) as again:
        assert len(again) == 7 and not again.contains(key(3))
        assert again.recovery.replayed_records == 9
        mem.clear()
        assert again.get([key(0)], [mem.runs(0)]) == [True] and mem.page(0).tobytes() == expected[key(0)]


def test_second_writer_is_refused(tmp_path):
    with open_store(tmp_path, sharing="off"):
        with pytest.raises(StoreLockedError, match=f"already open for writing by pid {os.getpid()}"):
            open_store(tmp_path, sharing="off")
    open_store(tmp_path, sharing="off").close()  # free again after close


def test_namespaces_are_isolated(tmp_path):
    mem = HostMemory(4)
    with open_store(tmp_path) as a:
        put_range(a, mem, 0, 4)
    other = namespace(model="other-model")
    with open_store(tmp_path, ns=other) as b:
        assert b.longest_prefix([key(i) for i in range(4)]) == 0
    with open_store(tmp_path, ns=namespace(layout="layer_first")) as c:
        assert c.get([key(0)], [mem.runs(0)]) == [False]


def test_files_are_private(tmp_path):
    mem = HostMemory(2)
    with open_store(tmp_path) as store:
        put_range(store, mem, 0, 2)
        meta = store.layout.meta
    assert stat.S_IMODE(meta.stat().st_mode) == 0o700
    for p in meta.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


def test_missing_device_fails_at_open(tmp_path):
    with pytest.raises(DeviceError, match="does not exist"):
        open_store(tmp_path, devices=[str(tmp_path / "nope")])
    with pytest.raises(DeviceError, match="does not exist"):
        open_store(tmp_path, devices=[str(tmp_path), str(tmp_path / "nope")])


def test_unwritable_device_fails_at_open(tmp_path):
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(DeviceError, match="ro"):
            open_store(ro)
        return
    ro = tmp_path / "ro"  # root ignores mode bits: a read-only mount is the real thing
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        with pytest.raises(DeviceError, match=str(ro)):
            open_store(ro)
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_too_small_device_fails_at_open(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        with pytest.raises(DeviceError, match="too small"):
            open_store(small, capacity_pages=64, page_bytes=PAGE_BYTES)  # 1 MiB wanted, 256 KiB there
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_striping_over_devices_and_refusing_a_changed_device_list(tmp_path):
    devs = [tmp_path / "d0", tmp_path / "d1", tmp_path / "d2"]
    for d in devs:
        d.mkdir()
    mem = HostMemory(12)
    with open_store(tmp_path, devices=[str(d) for d in devs], capacity_pages=12) as store:
        _, expected = put_range(store, mem, 0, 12)
    for d in devs:
        segs = list(d.glob("ns-*/w-*/seg-*.dat"))
        assert len(segs) == 1, d
    mem.clear()
    with open_store(tmp_path, devices=[str(d) for d in devs], capacity_pages=12) as store:
        assert store.get(list(expected), [mem.runs(i) for i in range(12)]) == [True] * 12
    from sgl_kvtier.errors import StoreFormatError
    with pytest.raises((StoreFormatError, DeviceError)):
        open_store(tmp_path, devices=[str(devs[1]), str(devs[0]), str(devs[2])], capacity_pages=12)


def test_three_threads_at_once(tmp_path):
    """SGLang's exists, get and set threads hammer one store; every served page is exact."""
    mem = HostMemory(96)
    payload = {i: mem.fill(i, i) for i in range(64)}
    errors = []
    with open_store(tmp_path, capacity_pages=48) as store:
        def writer():
            for start in range(0, 64, 8):
                store.put([key(i) for i in range(start, start + 8)], [mem.runs(i) for i in range(start, start + 8)])

        def reader(base=64):
            for _ in range(40):
                ks = [key(i) for i in range(0, 64, 3)]
                slots = [base + j for j in range(len(ks))]
                got = store.get(ks, [mem.runs(s) for s in slots])
                for k, s, ok in zip(ks, slots, got):
                    if ok and mem.page(s).tobytes() != payload[int.from_bytes(k[:4], "little")]:
                        errors.append(k)

        def exister():
            for _ in range(200):
                n = store.longest_prefix([key(i) for i in range(64)])
                if not 0 <= n <= 64:
                    errors.append(n)

        run_concurrently(writer, reader, exister)
        assert errors == []
        assert len(store) <= 48


@pytest.mark.parametrize("durability", list(Durability))
def test_durability_modes_round_trip(tmp_path, durability):
    mem = HostMemory(4)
    with open_store(tmp_path, durability=durability.value) as store:
        ok, expected = put_range(store, mem, 0, 4)
        assert ok == [True] * 4
    with open_store(tmp_path, durability=durability.value) as store:
        assert store.longest_prefix(list(expected)) == 4


@pytest.mark.parametrize("engine", ["threads", "uring"])
def test_io_engines_round_trip(tmp_path, engine):
    if engine == "uring":
        from sgl_kvtier.io.uring import UringEngine

        if not UringEngine.probe():
            pytest.skip("io_uring is not available here")
    mem, odd = HostMemory(16), HostMemory(4, offset=512)
    with open_store(tmp_path, io_engine=engine) as store:
        assert store.stats().engine == engine
        _, expected = put_range(store, mem, 0, 16)
        _, expected_odd = put_range(store, odd, 100, 4)
        mem.clear()
        assert store.get(list(expected), [mem.runs(i) for i in range(16)]) == [True] * 16
        assert [mem.page(i).tobytes() for i in range(16)] == list(expected.values())
        assert store.get(list(expected_odd), [mem.runs(i) for i in range(4)]) == [True] * 4


def test_chain_links_survive_a_restart(tmp_path):
    mem = HostMemory(4)
    with open_store(tmp_path) as store:
        put_range(store, mem, 0, 3)
        store.get([key(0)], [mem.runs(0)])  # the head is now the hottest: it is listed after its tails
    with open_store(tmp_path) as store:
        assert store.parent_of(key(1)) == key(0) and store.parent_of(key(2)) == key(1)
        assert store.parent_of(key(0)) is None
