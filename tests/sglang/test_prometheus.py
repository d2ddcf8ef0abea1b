"""``kvtier_`` Prometheus gauges from a real backend over a real SGLang host pool, and in a real SGLang
server's own ``/metrics`` (CPU, ``--enable-metrics``).

The in-process tests read ``KVTierStorage.telemetry()`` through an ``Exporter`` over a private registry
(directly, and as ``get_stats`` feeds it); the server test reads ``/metrics`` as a scraper would: SGLang's
scheduler calls ``KVTierStorage.get_stats`` (which refreshes the gauges) on every loop with
``--enable-metrics``; the cost policy is on so that the prefill gauges have samples.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from pools import fill_random, mha_host_pool, storage_config  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from sgl_kvtier.policy.cost_inputs import ENV_POLICY, PrefillSampler  # noqa: E402
from sgl_kvtier.policy.cost_model import DeviceModel, PrefillEstimator  # noqa: E402
from sgl_kvtier.sglang import KVTierStorage  # noqa: E402
from sgl_kvtier.sglang.host_shard import WritersGone  # noqa: E402
from sgl_kvtier.telemetry import prometheus  # noqa: E402
from sgl_kvtier.telemetry.snapshot import SHARING_COUNTERS, WriterSnapshot, WriterState  # noqa: E402

PS = 16
RANKS = {"tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}
KV = {"pool": "kv", **RANKS}


def make_backend(tmp_path, seed: int = 21, **more) -> KVTierStorage:
    """Our backend on a real host pool, its shard striped over ``tmp_path``/d0 and d1 (made if missing);
    ``more``: further keys of its config."""
    devices = [tmp_path / "d0", tmp_path / "d1"]
    for d in devices:
        d.mkdir(exist_ok=True)
    pool = mha_host_pool("page_first")
    fill_random(pool, seed=seed)
    page_bytes = pool.get_dummy_flat_data_page().numel() * 2
    cfg = {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang", "class_name": "KVTierStorage",
           "interface_v1": 1, "devices": [str(d) for d in devices], "capacity_bytes": 32 * page_bytes,
           "readahead_bytes": 256 << 20, "follow_interval_s": 0.0,  # read-ahead is off by default; tested here
           **more}
    b = KVTierStorage(storage_config(cfg), {})
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()  # as SGLang's controller does once every pool is registered
    return b


@pytest.fixture
def backend(tmp_path, monkeypatch):
    """Our backend on a real host pool, its shard striped over two directories, the cost policy off."""
    monkeypatch.delenv(ENV_POLICY, raising=False)
    b = make_backend(tmp_path)
    b.cost.prefill = PrefillSampler(estimator=PrefillEstimator(min_samples=2))
    yield b
    b.close()


def keys(n: int) -> list[str]:
    return [f"{i + 1:064x}" for i in range(n)]


def slots(pages) -> torch.Tensor:
    return torch.cat([torch.arange(p * PS, (p + 1) * PS, dtype=torch.int64) for p in pages])


def fill(backend: KVTierStorage, pages: int = 8) -> None:
    """``pages`` written, found (read-ahead starts their reads) and read back, as SGLang would."""
    assert backend.batch_set_v1(keys(pages), slots(range(pages))) == [True] * pages
    assert backend.batch_exists(keys(pages)) == pages
    assert backend.batch_get_v1(keys(pages), slots(range(20, 20 + pages))) == [True] * pages


def test_gauges_show_the_store_and_the_measured_inputs(backend):
    registry = CollectorRegistry()
    exporter = prometheus.Exporter(registry)
    value = registry.get_sample_value
    store = backend.kv.store
    fill(backend)
    exporter.update(backend.telemetry())
    assert value("kvtier_store_pages", KV) == 8
    assert value("kvtier_store_bytes_used", KV) == 8 * store.slot_bytes
    assert value("kvtier_store_capacity_bytes", KV) == store.stats().capacity_bytes > 0
    assert value("kvtier_store_put_pages", KV) == value("kvtier_store_get_hits", KV) == 8
    assert value("kvtier_store_bytes_read", KV) == 8 * backend.kv.pages.page_bytes
    assert value("kvtier_read_samples", KV) == 1  # read-ahead read the 8 pages in one batch
    assert value("kvtier_read_bandwidth_bytes_per_second", KV) == store.read_rates.total.model().bandwidth_Bps > 0
    for i, path in enumerate(store.stats().devices):
        device = {**KV, "device": str(i), "path": path}
        assert value("kvtier_device_read_bandwidth_bytes_per_second", device) == \
            store.read_rates.devices[i].model().bandwidth_Bps > 0
        assert value("kvtier_device_breaker_state", device) == 0
    assert value("kvtier_readahead_staged", KV) == value("kvtier_readahead_served", KV) == 8
    assert value("kvtier_readahead_buffers_in_use", KV) == 0
    # Not measured yet: no series at all (never a made-up 0); the sample count is there.
    assert value("kvtier_prefill_per_token_seconds", RANKS) is None
    assert value("kvtier_prefill_samples", RANKS) == 0
    assert value("kvtier_cost_policy_enabled", RANKS) == 0
    assert value("kvtier_boundary_errors", {**RANKS, "kind": "unexpected"}) == 0

    for _ in range(3):  # device 1 fails three times in a row: its breaker opens
        store.health.record(1, ok=False)
    for tokens in (1000, 2000):
        backend.cost.prefill.estimator.record(tokens, 0, tokens * 1e-4)
    assert backend.batch_get_v1(keys(2), torch.arange(3, 3 + 2 * PS)) == [False] * 2  # not page aligned
    exporter.update(backend.telemetry())
    device1 = {**KV, "device": "1", "path": store.stats().devices[1]}
    assert value("kvtier_device_breaker_state", device1) == 1
    assert value("kvtier_device_breaker_trips", device1) == 1
    assert value("kvtier_prefill_samples", RANKS) == 2
    assert value("kvtier_prefill_per_token_seconds", RANKS) == pytest.approx(1e-4)
    assert value("kvtier_boundary_errors", {**RANKS, "kind": "expected"}) == 1


def test_gauges_show_every_writer_of_the_shared_pool(backend, tmp_path):
    """A second backend on the same devices (another server on this host) shares the pool: each writer
    has its series, the other one's from its lease; once it closes it is dead (live 0), its pages stay."""
    registry = CollectorRegistry()
    exporter = prometheus.Exporter(registry)
    value = registry.get_sample_value
    other = make_backend(tmp_path, seed=22)
    try:
        fill(backend, 8)
        peer_keys = [f"{i + 100:064x}" for i in range(4)]
        assert other.batch_set_v1(peer_keys, slots(range(4))) == [True] * 4
        other.kv.store.own.lease.beat()  # its lease now says 4 pages (beats run every heartbeat_s otherwise)
        store = backend.kv.store
        assert store.refresh(force=True)
        exporter.update(backend.telemetry())
        shared = {**KV, "namespace": store.namespace.digest().hex()}
        slot, cap = store.slot_bytes, store.config.capacity_bytes
        mine = {**shared, "wid": store.wid, "host": store.own.claim.host_id}
        theirs = {**shared, "wid": other.kv.store.wid, "host": other.kv.store.own.claim.host_id}
        assert store.wid != other.kv.store.wid
        assert value("kvtier_writer_pages", mine) == 8 and value("kvtier_writer_pages", theirs) == 4
        assert value("kvtier_writer_bytes_used", mine) == 8 * slot and value("kvtier_writer_bytes_used", theirs) == 4 * slot
        assert value("kvtier_writer_live", mine) == value("kvtier_writer_live", theirs) == 1
        assert 0 <= value("kvtier_writer_lease_age_seconds", theirs) < 600
        assert value("kvtier_writer_lease_age_seconds", mine) >= 0
        assert value("kvtier_pool_bytes_used", shared) == 12 * slot
        assert value("kvtier_pool_capacity_bytes", shared) == cap > 0
        assert value("kvtier_pool_writers", {**shared, "state": "live"}) == 2
        assert value("kvtier_pool_writers", {**shared, "state": "dead"}) == 0
    finally:
        other.close()
    store.refresh(force=True)
    exporter.update(backend.telemetry())
    assert value("kvtier_writer_live", theirs) == 0 and value("kvtier_writer_pages", theirs) == 4
    assert value("kvtier_pool_writers", {**shared, "state": "live"}) == 1
    assert value("kvtier_pool_writers", {**shared, "state": "dead"}) == 1


def cluster(host: str, **more) -> dict:
    """``sharing = "cluster"`` on this machine's local disk, as "host" ``host`` (see test_cluster_servers)."""
    return {"sharing": "cluster", "allow_local_fs": True, "direct_io": "auto", "host_id": host,
            "heartbeat_s": 0.1, **more}


def wait_for(what: str, ok, timeout_s: float = 60.0, poll_s: float = 0.05):
    """``ok()`` once it is truthy (polled), or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not (got := ok()):
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(poll_s)
    return got


def test_sharing_counters_are_the_pools(backend):
    assert tuple(backend.kv.store.sharing_stats()) == SHARING_COUNTERS
    store = backend.telemetry().pool("kv").store
    assert store.sharing == dict.fromkeys(SHARING_COUNTERS, 0)
    registry = CollectorRegistry()
    prometheus.Exporter(registry).update(backend.telemetry())
    shared = {**KV, "namespace": store.namespace}
    assert [registry.get_sample_value(f"kvtier_pool_{c}", shared) for c in SHARING_COUNTERS] == [0, 0, 0, 0]


def test_another_hosts_writer_is_watched_then_dead_then_retired(tmp_path, monkeypatch):
    """``sharing = "cluster"``, two "hosts" in one process: A sees B live (its lease counter advancing; how
    long it stood still is exported), then, once B is gone, dead after ``dead_after_s`` (its pages still
    counted), then retired by A's quota loop after ``reclaim_after_s``: dropped, counted, listed retired."""
    monkeypatch.delenv(ENV_POLICY, raising=False)
    a = make_backend(tmp_path, **cluster("ha", dead_after_s=3.0, reclaim_after_s=4.0))  # B beats every 0.1 s
    try:
        _watched_then_dead_then_retired(a, tmp_path)
    finally:
        a.close()


def test_a_fenced_writer_whose_lease_is_still_there_lists_no_pages(tmp_path, monkeypatch):
    """A retirer writes the FENCE first and deletes the LEASE after: in between, the writer is ``retired``
    with none of its lease's pages (they are no longer read), not with the lease's figures."""
    from sgl_kvtier.sharing.retire import write_fence

    monkeypatch.delenv(ENV_POLICY, raising=False)
    a = make_backend(tmp_path, **cluster("ha"))
    b = make_backend(tmp_path, seed=22, **cluster("hb"))
    try:
        store = a.kv.store
        assert b.batch_set_v1(keys(4), slots(range(4))) == [True] * 4
        b_wid = b.kv.store.wid
        wait_for("B's lease announces 4 pages", lambda: (store.refresh(force=True), store.leases().get(b_wid, {}))[1]
                 .get("pages") == 4)
        # B beats every 0.1 s: at its next beat it would find the fence and start over elsewhere, and a beat in
        # flight when the fence lands could run its quota step over the retired directory: A's refresh would no
        # longer list it. B's beats end here (a beat in progress first): a writer not beaten since the fence.
        b.kv.store.own.lease.close()
        assert write_fence(store.ns_meta / f"w-{b_wid}", b.kv.store.own.incarnation, "hc-0", "hc")
        store.refresh(force=True)
        row = next(w for w in a.telemetry().pool("kv").store.writers if w.wid == b_wid)
        assert store.leases()[b_wid]["pages"] == 4  # the lease is still there, as the retirer left it
        assert row.state is WriterState.RETIRED and row.pages == 0 and row.bytes_used == 0
        assert a.batch_exists(keys(4)) == 0  # and its pages are no longer read
    finally:
        b.close()
        a.close()


def _watched_then_dead_then_retired(a: KVTierStorage, tmp_path) -> None:
    b = make_backend(tmp_path, seed=22, **cluster("hb"))  # B would judge A dead only after 60 s
    registry = CollectorRegistry()
    exporter = prometheus.Exporter(registry)
    value = registry.get_sample_value
    store = a.kv.store
    try:
        assert b.batch_set_v1(keys(4), slots(range(4))) == [True] * 4
        b_wid = b.kv.store.wid
        wait_for("B's lease announces 4 pages", lambda: (store.refresh(force=True), store.leases().get(b_wid, {}))[1]
                 .get("pages") == 4)
        assert a.batch_exists(keys(4)) == 4  # announced: A serves B's pages
        exporter.update(a.telemetry())
        shared = {**KV, "namespace": store.namespace.digest().hex()}
        theirs = {**shared, "wid": b_wid, "host": "hb"}
        mine = {**shared, "wid": store.wid, "host": "ha"}
        assert value("kvtier_writer_live", theirs) == value("kvtier_writer_live", mine) == 1
        assert value("kvtier_writer_pages", theirs) == 4
        assert 0 <= value("kvtier_writer_lease_unchanged_seconds", theirs) < 3.0  # live: under dead_after_s
        assert value("kvtier_writer_lease_unchanged_seconds", mine) is None  # its own: no watch
    finally:
        b.close()  # B's lease stands still from here on: A's watch times it on A's clock

    def judged(state: WriterState):
        store.refresh(force=True)
        row = next((w for w in a.telemetry().pool("kv").store.writers if w.wid == b_wid), None)
        return row if row is not None and row.state is state else None

    dead = wait_for("A judges B dead", lambda: judged(WriterState.DEAD), timeout_s=30)
    assert dead.pages == 4 and dead.lease_unchanged_s >= 1.0
    retired = wait_for("A retires B", lambda: judged(WriterState.RETIRED), timeout_s=30)
    assert retired.pages == 0 and retired.bytes_used == 0
    # A's quota loop fences and deletes B on its own thread: the fence may land between judged()'s refresh and
    # its telemetry (which reads the fence itself), so A's view drops B's pages at the refresh after it; and a
    # refresh between the FENCE's unlink and the directory's rmdir still follows B with neither lease nor fence
    # (no row: its gauges keep their last values) until the next one finds the directory gone (seen once in CI).
    def exported_retired() -> bool:
        store.refresh(force=True)
        exporter.update(a.telemetry())
        return value("kvtier_writer_live", theirs) == 0 and value("kvtier_writer_pages", theirs) == 0

    wait_for("A's gauges show B retired", exported_retired, timeout_s=30)
    assert a.batch_exists(keys(4)) == 0  # no longer read
    assert value("kvtier_pool_writers", {**shared, "state": "retired"}) == 1
    assert value("kvtier_pool_writers", {**shared, "state": "live"}) == 1
    assert value("kvtier_pool_peers_dropped", shared) == value("kvtier_pool_writers_retired", shared) == 1
    assert value("kvtier_pool_fenced_pages", shared) == value("kvtier_pool_reregistrations", shared) == 0


def test_a_writer_that_left_the_pool_is_listed_retired_for_a_while():
    live = WriterSnapshot("h-1", "h", WriterState.LIVE, 3, 3 * 4096, 0.1)
    own = WriterSnapshot("h-0", "h", WriterState.LIVE, 1, 4096, 0.1, own=True)
    gone = WritersGone(shown_s=60.0)
    assert gone.update((own, live), 0.0, {"h-1"}) == (own, live)
    assert gone.update((own,), 1.0, {"h-1"}) == (own,)  # still followed (no lease this once): not gone
    left = gone.update((own,), 2.0, set())
    assert left == (own, WriterSnapshot("h-1", "h", WriterState.RETIRED, 0, 0))
    assert gone.update((own,), 59.0, set()) == left  # listed for shown_s after it was last seen ...
    assert gone.update((own,), 62.0, set()) == (own,)  # ... then no longer
    assert gone.update((own,), 63.0, set()) == (own,)


def test_get_stats_refreshes_the_gauges_once_per_interval(backend, monkeypatch, tmp_path):
    monkeypatch.setenv(prometheus.ENV_MULTIPROC_DIR, str(tmp_path))
    monkeypatch.delenv(prometheus.ENV_INTERVAL, raising=False)
    registry = CollectorRegistry()
    backend._metrics = prometheus.PrometheusFeed(True, backend.boundary,
                                                 prometheus.ProcessGauges(lambda: prometheus.Exporter(registry)))
    fill(backend, 2)
    backend.get_stats()
    assert registry.get_sample_value("kvtier_store_pages", KV) == 2
    assert backend.batch_set_v1(keys(4), slots(range(4))) == [True] * 4
    backend.get_stats()  # the same scheduler second: not refreshed
    assert registry.get_sample_value("kvtier_store_pages", KV) == 2


def test_cost_inputs_are_the_snapshots_json_view(backend):
    fill(backend)
    inputs = backend.cost_inputs()
    snap = backend.telemetry()
    assert inputs == snap.cost_inputs()
    assert inputs["policy"] == "off" and inputs["prefill"]["samples"] == 0 and inputs["prefill"]["source"] is None
    kv = inputs["pools"]["kv"]
    assert kv["page_bytes"] == backend.kv.pages.page_bytes and kv["read"]["samples"] == 1
    paths = [d.path for d in snap.pool("kv").store.devices]
    assert [d["path"] for d in kv["devices"]] == paths == backend.kv.store.stats().devices


# ---------------------------------------------------------------------------------------------- real server
def scrape(srv) -> dict[str, list[tuple[dict, float]]]:
    """Every ``kvtier_`` sample on ``/metrics``: name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    status, raw = srv.request("GET", "/metrics", None, timeout_s=30.0)
    assert status == 200
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            if sample.name.startswith("kvtier_"):
                out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def only(samples: dict, name: str, **labels: str) -> float:
    """The one value of ``name`` whose labels include ``labels``."""
    found = [v for lab, v in samples.get(name, []) if labels.items() <= lab.items()]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


@pytest.mark.server
@pytest.mark.timeout(600)
def test_a_real_server_shows_kvtier_gauges_on_its_metrics(tmp_path: Path) -> None:
    pytest.importorskip("sglang")
    from test_kvtier_server import BACKED_UP, HIT, PAGE, PROMPT, server_args

    from sgl_kvtier.serving.model_factory import make_model, make_prompt
    from sgl_kvtier.serving.server import SGLangServer, tracebacks_through

    model = make_model(tmp_path / "model", "tiny")
    store = tmp_path / "flash"
    store.mkdir()
    prompt = make_prompt(PROMPT, seed=5, model_dir=model)
    env = {ENV_POLICY: "cost", prometheus.ENV_INTERVAL: "0"}  # every get_stats refreshes
    with SGLangServer(model, extra_args=server_args(store), env=env, log_path=tmp_path / "s.log") as srv:
        srv.generate(prompt, max_new_tokens=4)
        srv.wait_metric(BACKED_UP, HIT, timeout_s=180)
        srv.flush_cache()
        warm = srv.generate(prompt, max_new_tokens=4)  # its pages come back from our store
        assert warm["meta_info"]["cached_tokens_details"]["storage"] == HIT
        got = scrape(srv)  # refreshed by the warm request's batches, after its read
        for salt in "abcd":  # prefill samples past the plugin's warm-up (short prompts: no L3 query)
            srv.generate(make_prompt(64, seed=7, model_dir=model), max_new_tokens=1, cache_salt=salt)
        # The last batch's sample is taken after its answer went out, and the gauges refresh at the
        # scheduler's next step: polled, as a client would.
        def sampled() -> dict | None:
            now = scrape(srv)
            return now if any(v >= 4 for _, v in now.get("kvtier_prefill_samples", [])) else None

        later = wait_for("4 prefill samples on /metrics", sampled, timeout_s=30, poll_s=0.2)
    pages = HIT // PAGE
    kv = {"pool": "kv", "tp_rank": "0"}
    assert only(got, "kvtier_store_pages", **kv) == pages
    assert only(got, "kvtier_store_put_pages", **kv) == only(got, "kvtier_store_get_hits", **kv) == pages
    used, capacity = only(got, "kvtier_store_bytes_used", **kv), only(got, "kvtier_store_capacity_bytes", **kv)
    assert 0 < used <= capacity <= 256 << 20 and used % pages == 0
    assert only(got, "kvtier_store_io_errors", **kv) == only(got, "kvtier_store_corrupt_pages", **kv) == 0
    assert only(got, "kvtier_read_samples", **kv) >= 1
    device = {**kv, "device": "0", "path": str(store)}
    for prefix, labels in (("kvtier_read", kv), ("kvtier_device_read", device)):
        # A fit may put all the time in the batch latency (bandwidth +Inf); the load time it predicts for
        # the hit must be positive and plausible either way.
        read = DeviceModel(only(got, f"{prefix}_bandwidth_bytes_per_second", **labels),
                           only(got, f"{prefix}_batch_latency_seconds", **labels))
        assert read.bandwidth_Bps > 0 and read.batch_latency_s >= 0, read
        assert 0 < read.load_time(pages, used // pages) < 10, read
    assert only(got, "kvtier_device_breaker_state", **device) == 0
    assert only(got, "kvtier_readahead_staged", **kv) == only(got, "kvtier_readahead_served", **kv) == pages
    assert only(got, "kvtier_readahead_buffers_in_use", **kv) == 0
    assert only(got, "kvtier_cost_policy_enabled", tp_rank="0") == 1
    assert only(later, "kvtier_prefill_samples", tp_rank="0") >= 4
    per_token = [only(later, f"kvtier_prefill_{k}", tp_rank="0") for k in ("per_token_seconds",
                                                                           "per_token_kctx_seconds", "fixed_seconds")]
    assert all(0 <= v < 10 for v in per_token) and any(v > 0 for v in per_token), per_token
    assert tracebacks_through((tmp_path / "s.log").read_text(errors="replace")) == []
