"""A host shard under ``sharing = "off"``: the shard's one writer alone (``sharing.sole.SoleShard``) behind
SGLang's calls, its telemetry and gauges, a restart, and a second backend refused naming the holder.

A real backend over a real SGLang host pool on the CPU (``test_prometheus.make_backend``); no sleeps.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from pools import fill_random, mha_host_pool  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from support import kvtier_threads  # noqa: E402
from test_prometheus import KV, fill, keys, make_backend, slots  # noqa: E402

from sgl_kvtier.errors import StoreLockedError  # noqa: E402
from sgl_kvtier.policy.cost_inputs import ENV_POLICY  # noqa: E402
from sgl_kvtier.sharing.lease import THREAD_NAME  # noqa: E402
from sgl_kvtier.sharing.pool import SharedPool  # noqa: E402
from sgl_kvtier.sharing.sole import SoleShard  # noqa: E402
from sgl_kvtier.telemetry import prometheus  # noqa: E402
from sgl_kvtier.telemetry.snapshot import SHARING_COUNTERS, WriterState  # noqa: E402

PS = 16


def test_an_off_host_shard_serves_one_plain_shard_and_reports_it(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_POLICY, raising=False)
    before = kvtier_threads()
    backend = make_backend(tmp_path, sharing="off")
    try:
        store = backend.kv.store
        assert isinstance(store, SoleShard) and not isinstance(store, SharedPool)
        assert store.own is not None and store.own.lease is None
        assert {t.name for t in kvtier_threads() - before}.isdisjoint({THREAD_NAME})
        fill(backend, 8)
        snap = backend.telemetry().pool("kv").store
        (writer,) = snap.writers
        assert writer.own and writer.wid == store.wid and writer.state is WriterState.LIVE
        assert writer.pages == 8 and writer.bytes_used == 8 * store.slot_bytes
        assert writer.lease_age_s is None and writer.lease_unchanged_s is None  # it beats no lease
        assert snap.pages == 8 and snap.pool_bytes_used == 8 * store.slot_bytes
        assert snap.pool_capacity_bytes == store.config.capacity_bytes
        assert snap.sharing == dict.fromkeys(SHARING_COUNTERS, 0)
        registry = CollectorRegistry()
        prometheus.Exporter(registry).update(backend.telemetry())
        value = registry.get_sample_value
        shared = {**KV, "namespace": snap.namespace}
        mine = {**shared, "wid": writer.wid, "host": writer.host}
        assert value("kvtier_store_pages", KV) == 8 and value("kvtier_writer_pages", mine) == 8
        assert value("kvtier_writer_live", mine) == 1 and value("kvtier_writer_lease_age_seconds", mine) is None
        assert value("kvtier_pool_writers", {**shared, "state": "live"}) == 1
        # A second backend on the same shard (another server) is refused, naming this one.
        with pytest.raises(StoreLockedError, match=f"already open for writing by pid {os.getpid()}"):
            make_backend(tmp_path, seed=23, sharing="off")
    finally:
        backend.close()
    assert {t.name for t in kvtier_threads() - before} == set()


def test_an_off_host_shard_serves_its_pages_byte_exact_after_a_restart(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_POLICY, raising=False)
    first = make_backend(tmp_path, seed=21, sharing="off")
    try:
        assert first.batch_set_v1(keys(6), slots(range(6))) == [True] * 6
    finally:
        first.close()
    again = make_backend(tmp_path, seed=77, sharing="off")  # another host pool's bytes everywhere
    try:
        assert again.batch_exists(keys(6)) == 6
        assert again.batch_get_v1(keys(6), slots(range(30, 36))) == [True] * 6
        written = mha_host_pool("page_first")
        fill_random(written, seed=21)  # what the first backend's pool held
        pool = again.kv.pages.pool
        for i in range(6):
            got, want = pool.get_data_page((30 + i) * PS, flat=True), written.get_data_page(i * PS, flat=True)
            assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    finally:
        again.close()
