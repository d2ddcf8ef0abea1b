"""The adapter boundary: a bug (here a TypeError injected into the store) never reaches SGLang's threads.

Every ``HiCacheStorage`` method SGLang calls answers its miss, the backend's ``ErrorBoundary`` counts the
exception as unexpected, and the log carries its traceback: first method by method on a real host pool,
then under SGLang's own ``HiCacheController`` threads (backup, prefetch query, prefetch IO), whose own
failure handlers must never fire.
"""

from __future__ import annotations

import logging
import time

import pytest

pytest.importorskip("sglang")

from pools import fill_random, mha_host_pool  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer, PoolTransferResult  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402
from test_controller import DEADLINE_S, PS, controller, get_before, token_ids  # noqa: E402
from test_storage_adapter import chain_keys, make_backend, slots  # noqa: E402

from sgl_kvtier.telemetry import prometheus  # noqa: E402
from sgl_kvtier.telemetry.counters import BoundaryCounts  # noqa: E402


def _flat(backend, page: int):
    return backend.kv.pages.pool.get_data_page(page * PS, flat=True).clone()


def _side(keys, pages):
    return [PoolTransfer(name=PoolName.DRAFT, host_indices=slots(pages), keys=keys)]


# SGLang's call -> (the store method a bug breaks, the call, what SGLang must get back)
BUG_CASES = {
    "batch_exists": ("longest_prefix", lambda b, keys: b.batch_exists(keys), 0),
    "exists": ("longest_prefix", lambda b, keys: b.exists(keys[0]), False),
    "batch_exists_v2": ("contains", lambda b, keys: b.batch_exists_v2(keys, _side(keys, [0, 1, 2, 3])),
                        PoolTransferResult.empty()),
    "batch_get_v1": ("get", lambda b, keys: b.batch_get_v1(keys, slots([20, 21, 22, 23])), [False] * 4),
    "batch_get": ("get", lambda b, keys: b.batch_get(keys), [None] * 4),
    "get": ("get", lambda b, keys: b.get(keys[0]), None),
    "batch_get_v2": ("get", lambda b, keys: b.batch_get_v2(_side(keys[:2], [20, 21])), {"draft": [False] * 2}),
    "batch_set_v1": ("put", lambda b, keys: b.batch_set_v1(chain_keys(2, "new"), slots([4, 5])), [False] * 2),
    "batch_set": ("put", lambda b, keys: b.batch_set(chain_keys(1, "new"), [_flat(b, 4)]), False),
    "set": ("put", lambda b, keys: b.set(chain_keys(1, "new")[0], _flat(b, 4)), False),
    "batch_set_v2": ("put", lambda b, keys: b.batch_set_v2(_side(chain_keys(1, "new"), [4])), {"draft": [False]}),
    "clear": ("clear", lambda b, keys: b.clear(), None),
}


@pytest.mark.parametrize("call", sorted(BUG_CASES))
def test_a_bug_in_the_store_is_a_miss_counted_and_logged_with_its_traceback(tmp_path, monkeypatch, caplog, call):
    """A TypeError (a bug, not an IO fault) from inside the store never reaches SGLang's thread: each
    HiCacheStorage method answers its miss, the boundary counts it as unexpected, the log has its traceback."""
    broken, sglang_calls, miss = BUG_CASES[call]
    pool, side = mha_host_pool("page_first"), mha_host_pool("page_first", layers=1)
    fill_random(pool, seed=14)
    backend = make_backend(tmp_path, pool, readahead_bytes=0)  # reads go straight to the store
    backend.register_mem_host_pool_v2(side, PoolName.DRAFT)
    keys = chain_keys(4)
    assert backend.batch_set_v1(keys, slots([0, 1, 2, 3])) == [True] * 4
    assert backend.batch_set_v2(_side(keys, [0, 1, 2, 3])) == {"draft": [True] * 4}
    message = f"injected bug in {broken}"

    def bug(*args, **kwargs):
        raise TypeError(message)

    monkeypatch.setattr(backend.shards["draft" if call.endswith("_v2") else "kv"].store, broken, bug)
    with caplog.at_level(logging.ERROR, logger="sgl_kvtier"):
        assert sglang_calls(backend, keys) == miss
    assert backend.telemetry().boundary == BoundaryCounts(expected=0, unexpected=1)
    [record] = [r for r in caplog.records if message in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is TypeError and record.levelno == logging.ERROR
    assert "Traceback (most recent call last)" in caplog.text
    monkeypatch.undo()
    backend.close()


def test_get_stats_and_close_never_raise(tmp_path, monkeypatch, caplog):
    pool = mha_host_pool("page_first")
    backend = make_backend(tmp_path, pool)
    monkeypatch.setenv(prometheus.ENV_MULTIPROC_DIR, str(tmp_path))
    monkeypatch.setenv(prometheus.ENV_INTERVAL, "0")
    registry = prometheus.ProcessGauges(lambda: prometheus.Exporter(CollectorRegistry()))
    backend._metrics = prometheus.PrometheusFeed(True, backend.boundary, registry)

    def bug(*args, **kwargs):
        raise KeyError("injected bug in stats")

    monkeypatch.setattr(backend.kv.store, "stats", bug)
    with caplog.at_level(logging.ERROR, logger="sgl_kvtier"):
        assert isinstance(backend.get_stats(), StorageMetrics)  # the gauges are not refreshed; SGLang's figures are
        assert backend.telemetry is not None
        monkeypatch.setattr(backend.kv.store, "close", bug)
        backend.close()
    assert backend.boundary.counts() == BoundaryCounts(expected=0, unexpected=2)
    assert [r.exc_info[0] for r in caplog.records if "injected bug" in r.getMessage()] == [KeyError, KeyError]
    assert backend.shards == {} and backend.kv is None


def test_a_bug_in_the_store_reaches_sglangs_threads_as_a_miss(tmp_path, single_rank, monkeypatch, caplog):
    """A TypeError (a bug, not an IO fault) raised inside the store under SGLang's own backup, prefetch and
    IO threads: SGLang sees a failed set, a miss, unread pages; nothing escapes into its threads (it logs no
    failure of its own), the boundary counts each, and each is logged with its traceback."""
    n_pages = 8
    n_tokens = n_pages * PS
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PS))
    device, allocator, host, ctl = controller(tmp_path, 4 * n_tokens, "tiny-bug-test", readahead_bytes=0)
    try:
        backend = ctl.storage_backend
        store = backend.kv.store
        tokens = token_ids(n_tokens, "bug")
        keys = get_storage_hash_str(tokens, None, page_size=PS)
        host_idx = ctl.write(allocator.alloc(n_tokens), node_id=1)
        ctl.ack_write_queue[0].finish_event.synchronize()
        ctl.ack_write_queue.clear()

        def bug(*args, **kwargs):
            raise TypeError("injected bug in the store")

        def backup() -> int:
            ctl.write_storage(host_idx, tokens, hash_value=keys)
            return get_before(ctl.ack_backup_queue, time.monotonic() + DEADLINE_S, "the L3 backup ack").completed_tokens

        def hit_query(rid: str):
            ctl.prefetch(rid, tokens)
            return get_before(ctl.prefetch_hit_queue, time.monotonic() + DEADLINE_S, "the storage hit query")

        with caplog.at_level(logging.ERROR):
            with monkeypatch.context() as m:
                m.setattr(store, "put", bug)
                assert backup() == 0  # a failed set: SGLang stops the op, nothing stored
            assert backup() == n_tokens and len(store) == n_pages
            with monkeypatch.context() as m:
                m.setattr(store, "longest_prefix", bug)
                assert hit_query("req-bug-exists").storage_hit_count == 0  # a miss
            hit = hit_query("req-bug-get")
            assert hit.storage_hit_count == n_tokens
            with monkeypatch.context() as m:
                m.setattr(store, "get", bug)
                hit.host_indices = ctl.alloc_prefetch_host_buffers(hit, n_tokens)
                ctl.prefetch_buffer.put(hit)
                acks = [get_before(ctl.ack_prefetch_queue, time.monotonic() + DEADLINE_S, "the prefetch acks")
                        for _ in range(2)]
            assert [(a.completed_tokens, a.completed_req) for a in acks] == [(0, None), (None, True)]  # unread
    finally:
        ctl.detach_storage_backend()
    ours = [r for r in caplog.records if "injected bug in the store" in r.getMessage()]
    assert [r.getMessage().split(" failed")[0] for r in ours] == ["kvtier batch_set_v1", "kvtier batch_exists",
                                                                   "kvtier batch_get_v1"]
    assert all(r.exc_info is not None and r.exc_info[0] is TypeError for r in ours)
    assert backend.boundary.counts() == BoundaryCounts(expected=0, unexpected=3)
    assert [r for r in caplog.records if r.name.startswith("sglang") and r.exc_info] == []  # nothing escaped
