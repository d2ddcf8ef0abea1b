"""KVTierStorage's extensions (``storage.Extension``, ``storage.EXTENSIONS``): without one a read goes straight to
the KV shard; a registered one is made per backend, answers reads first, reports its telemetry, is closed before
the stores, and its failures stay behind the boundary."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from pools import fill_random, mha_host_pool, page_bytes, zero  # noqa: E402
from test_storage_adapter import PS, chain_keys, make_backend, slots  # noqa: E402

from sgl_kvtier.sglang import storage  # noqa: E402
from sgl_kvtier.telemetry.counters import BoundaryCounts  # noqa: E402
from sgl_kvtier.telemetry.snapshot import StreamSnapshot  # noqa: E402


class Recording:
    """An extension that answers the reads of ``claimed`` keys itself and records what the backend asks."""

    made: list[Recording] = []

    def __init__(self, backend):
        self.backend_had_kv = backend.kv is not None
        self.claimed: set[str] = set()
        self.calls: list[str] = []
        self.raise_on: set[str] = set()
        Recording.made.append(self)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.raise_on:
            raise RuntimeError(f"injected failure in {name}")

    def answer(self, keys, host_indices):
        self._call("answer")
        if keys and keys[0] is not None and keys[0].hex() in self.claimed:
            return [True] * len(keys)
        return None

    def pools_registered(self):
        self._call("pools_registered")

    def snapshot(self):
        self._call("snapshot")
        return StreamSnapshot(bound_hits=7, read_groups=0, head_pages=0, streamed_pages=0, staged_pages=0,
                              failed_pages=0, failed_groups=0, cancelled=0, read_errors=0, withheld_pages=0,
                              mismatches=0, hooks=None, bind=None)

    def close(self):
        self._call("close")


@pytest.fixture
def recording(monkeypatch):
    Recording.made = []
    monkeypatch.setattr(storage, "EXTENSIONS", [Recording])
    return Recording.made


def test_without_extensions_reads_go_straight_to_the_kv_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "EXTENSIONS", [])
    pool = mha_host_pool("layer_first")
    fill_random(pool, seed=3)
    backend = make_backend(tmp_path, pool)
    try:
        assert backend.extensions == ()
        keys = chain_keys(4)
        expected = [page_bytes(pool, p * PS) for p in (1, 2, 3, 4)]
        assert backend.batch_set_v1(keys, slots([1, 2, 3, 4])) == [True] * 4
        zero(pool)
        assert backend.batch_get_v1(keys, slots([10, 11, 12, 13])) == [True] * 4
        assert [page_bytes(pool, p * PS) for p in (10, 11, 12, 13)] == expected
        assert backend.telemetry().stream is None
    finally:
        backend.close()


def test_an_extension_answers_first_reports_and_closes_before_the_stores(tmp_path, recording):
    pool = mha_host_pool("layer_first")
    fill_random(pool, seed=4)
    backend = make_backend(tmp_path, pool)
    ext = recording[0]
    assert backend.extensions == (ext,) and not ext.backend_had_kv  # made at construction, before registration
    assert ext.calls.count("pools_registered") == 2  # at the KV pool's registration and once all are known
    keys = chain_keys(3)
    assert backend.batch_set_v1(keys, slots([1, 2, 3])) == [True] * 3
    zero(pool)
    ext.claimed.add(keys[0])  # claimed: its answer stands, the shard is not read
    assert backend.batch_get_v1(keys, slots([20, 21, 22])) == [True] * 3
    assert page_bytes(pool, 20 * PS) == bytes(len(page_bytes(pool, 20 * PS)))
    ext.claimed.clear()  # not claimed: read from the shard
    assert backend.batch_get_v1(keys, slots([20, 21, 22])) == [True] * 3
    assert page_bytes(pool, 20 * PS) != bytes(len(page_bytes(pool, 20 * PS)))
    assert backend.telemetry().stream.bound_hits == 7
    backend.close()
    assert ext.calls[-1] == "close" and backend.kv is None


def test_an_extensions_failures_stay_behind_the_boundary(tmp_path, recording):
    pool = mha_host_pool("layer_first")
    backend = make_backend(tmp_path, pool)
    ext = recording[0]
    keys = chain_keys(2)
    assert backend.batch_set_v1(keys, slots([1, 2])) == [True] * 2
    ext.raise_on = {"answer", "snapshot", "close"}
    assert backend.batch_get_v1(keys, slots([5, 6])) == [False, False]  # a miss, never an exception
    assert backend.telemetry().stream is None  # the rest of the snapshot stands
    backend.close()  # the stores close whatever the extension raised
    assert backend.kv is None
    assert backend.boundary.counts() == BoundaryCounts(expected=3)  # answer, snapshot, close: each counted
