"""``kvtier_`` Prometheus gauges: values from a real store, inert without metrics, never raising, and in a
real SGLang server's own ``/metrics`` (CPU, ``--enable-metrics``).

The unit tests read an ``Exporter`` over a private registry; the server test reads ``/metrics`` as a
scraper would: SGLang's scheduler calls ``KVTierStorage.get_stats`` (which refreshes the gauges) on every
loop with ``--enable-metrics``; the cost policy is on so that the prefill gauges have samples.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from support import PAGE_BYTES, HostMemory, key, open_store

from sgl_kvtier.policy.cost_model import DeviceModel, PrefillEstimator
from sgl_kvtier.sglang import prometheus, throughput

RANKS = {"tp_rank": "2", "pp_rank": "0", "dp_rank": "1"}
KV = {"pool": "kv", **RANKS}


@pytest.fixture
def fresh(monkeypatch):
    """The module's process-wide state back to new (and restored after the test)."""
    for name, value in (("_exporter", None), ("_broken", False), ("_interval_s", None), ("_next", -math.inf)):
        monkeypatch.setattr(prometheus, name, value)
    monkeypatch.setattr(throughput, "PREFILL", PrefillEstimator(min_samples=2))
    monkeypatch.delenv(throughput.ENV_POLICY, raising=False)
    monkeypatch.delenv(prometheus.ENV_INTERVAL, raising=False)


@pytest.fixture
def store(tmp_path):
    devs = [tmp_path / "d0", tmp_path / "d1"]
    for d in devs:
        d.mkdir()
    with open_store(tmp_path, capacity_pages=32, devices=devs) as s:
        yield s


def backend_of(store, metrics: bool = True):
    cfg = SimpleNamespace(tp_rank=2, pp_rank=0, dp_rank=1, enable_storage_metrics=metrics)
    return SimpleNamespace(storage_config=cfg, tiers={"kv": SimpleNamespace(store=store)})


def fill(store, pages: int = 8) -> None:
    mem = HostMemory(pages)
    for i in range(pages):
        mem.fill(i, i)
    assert store.put([key(i) for i in range(pages)], [mem.runs(i) for i in range(pages)]) == [True] * pages
    assert store.get([key(i) for i in range(pages)], [mem.runs(i) for i in range(pages)]) == [True] * pages


def test_gauges_show_the_store_and_the_measured_inputs(fresh, store):
    registry = CollectorRegistry()
    exporter = prometheus.Exporter(registry)
    value = registry.get_sample_value
    fill(store)
    exporter.update(backend_of(store))
    assert value("kvtier_store_pages", KV) == 8
    assert value("kvtier_store_bytes_used", KV) == 8 * store.slot_bytes
    assert value("kvtier_store_capacity_bytes", KV) == 32 * store.slot_bytes
    assert value("kvtier_store_put_pages", KV) == value("kvtier_store_get_hits", KV) == 8
    assert value("kvtier_store_bytes_read", KV) == 8 * PAGE_BYTES
    assert value("kvtier_read_samples", KV) == 1
    assert value("kvtier_read_bandwidth_bytes_per_second", KV) == store.read_rates.total.model().bandwidth_Bps > 0
    for i, path in enumerate(store.stats().devices):
        device = {**KV, "device": str(i), "path": path}
        assert value("kvtier_device_read_bandwidth_bytes_per_second", device) == \
            store.read_rates.devices[i].model().bandwidth_Bps > 0
        assert value("kvtier_device_breaker_state", device) == 0
    # Not measured yet: no series at all (never a made-up 0); the sample count is there.
    assert value("kvtier_prefill_per_token_seconds", RANKS) is None
    assert value("kvtier_prefill_samples", RANKS) == 0
    assert value("kvtier_cost_policy_enabled", RANKS) == 0

    for _ in range(3):  # device 1 fails three times in a row: its breaker opens
        store.health.record(1, ok=False)
    for tokens in (1000, 2000):
        throughput.PREFILL.record(tokens, 0, tokens * 1e-4)
    exporter.update(backend_of(store))
    device1 = {**KV, "device": "1", "path": store.stats().devices[1]}
    assert value("kvtier_device_breaker_state", device1) == 1
    assert value("kvtier_device_breaker_trips", device1) == 1
    assert value("kvtier_prefill_samples", RANKS) == 2
    assert value("kvtier_prefill_per_token_seconds", RANKS) == pytest.approx(1e-4)


def test_inert_without_multiprocess_dir_or_with_metrics_off(fresh, store, monkeypatch, tmp_path):
    monkeypatch.delenv(prometheus.ENV_MULTIPROC_DIR, raising=False)
    assert prometheus.update(backend_of(store), now=10.0) is False
    monkeypatch.setenv(prometheus.ENV_MULTIPROC_DIR, str(tmp_path))
    assert prometheus.update(backend_of(store, metrics=False), now=20.0) is False
    assert prometheus.update(None, now=30.0) is False
    assert prometheus._exporter is None and list(tmp_path.glob("*.db")) == []  # nothing created, nothing written


def test_refreshes_at_most_once_per_interval_and_never_raises(fresh, store, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(prometheus.ENV_MULTIPROC_DIR, str(tmp_path))
    registry = CollectorRegistry()
    monkeypatch.setattr(prometheus, "_exporter", prometheus.Exporter(registry))
    backend = backend_of(store)
    fill(store, 2)
    assert prometheus.update(backend, now=100.0) is True
    fill(store, 4)
    assert prometheus.update(backend, now=100.5) is False  # within the default 1 s
    assert registry.get_sample_value("kvtier_store_pages", KV) == 2
    assert prometheus.update(backend, now=101.0) is True
    assert registry.get_sample_value("kvtier_store_pages", KV) == 4

    def broken():
        raise OSError("disk gone")

    monkeypatch.setattr(store, "stats", broken)
    assert prometheus.update(backend, now=102.0) is False  # logged, not raised
    assert "disk gone" in caplog.text


def test_gauges_stay_off_when_they_cannot_be_created(fresh, store, monkeypatch, tmp_path):
    monkeypatch.setenv(prometheus.ENV_MULTIPROC_DIR, str(tmp_path))
    calls = []

    def refuse(registry=None):
        calls.append(registry)
        raise ValueError("Duplicated timeseries in CollectorRegistry")

    monkeypatch.setattr(prometheus, "Exporter", refuse)
    assert prometheus.update(backend_of(store), now=1.0) is False
    assert prometheus.update(backend_of(store), now=5.0) is False
    assert len(calls) == 1  # not retried on every scheduler step


def test_interval_from_the_environment(fresh, monkeypatch):
    monkeypatch.setenv(prometheus.ENV_INTERVAL, "0")
    assert prometheus._interval() == 0.0
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv(prometheus.ENV_INTERVAL, bad)
        assert prometheus._interval() == prometheus.DEFAULT_INTERVAL_S


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


@pytest.mark.timeout(600)
def test_a_real_server_shows_kvtier_gauges_on_its_metrics(tmp_path: Path) -> None:
    pytest.importorskip("sglang")
    from test_kvtier_server import BACKED_UP, HIT, PAGE, PROMPT, server_args

    from sgl_kvtier.sglang.model_factory import make_model, make_prompt
    from sgl_kvtier.sglang.server import SGLangServer, tracebacks_through

    model = make_model(tmp_path / "model", "tiny")
    store = tmp_path / "flash"
    store.mkdir()
    prompt = make_prompt(PROMPT, seed=5, model_dir=model)
    env = {throughput.ENV_POLICY: "cost", prometheus.ENV_INTERVAL: "0"}  # every get_stats refreshes
    with SGLangServer(model, extra_args=server_args(store), env=env, log_path=tmp_path / "s.log") as srv:
        srv.generate(prompt, max_new_tokens=4)
        srv.wait_metric(BACKED_UP, HIT, timeout_s=180)
        srv.flush_cache()
        warm = srv.generate(prompt, max_new_tokens=4)  # its pages come back from our store
        assert warm["meta_info"]["cached_tokens_details"]["storage"] == HIT
        got = scrape(srv)  # refreshed by the warm request's batches, after its read
        for salt in "abcd":  # prefill samples past the plugin's warm-up (short prompts: no L3 query)
            srv.generate(make_prompt(64, seed=7, model_dir=model), max_new_tokens=1, cache_salt=salt)
        later = scrape(srv)
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
