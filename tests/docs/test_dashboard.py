"""The Grafana dashboard and the alert examples: importable JSON, every PromQL expression parses, and every metric
it uses is one the exporter really emits, with labels it really has, or one the installed SGLang defines."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from docs_support import (
    DASHBOARD,
    DOCS,
    SCRAPE_LABELS,
    grafana_to_promql,
    hooks,
    kvtier_series,
    matchers,
    metric_name,
    selectors,
    sglang_metrics,
)

DS = "${DS_PROMETHEUS}"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every query in the dashboard: the panels' targets and the variables' queries."""
    out = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in panels() for t in p["targets"]]
    for var in dashboard()["templating"]["list"]:
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert match, f"variable {var['name']}: not a label_values(selector, label) query: {query}"
        out.append((f"variable {var['name']}", match.group(1)))
    return out


def alert_rules() -> list[dict]:
    """The rules of the Prometheus rule file that the monitoring page shows."""
    blocks = re.findall(r"```yaml\n(.*?)```", (DOCS / "operations" / "monitoring.md").read_text(), re.S)
    files = [doc for doc in map(yaml.safe_load, blocks) if isinstance(doc, dict) and "groups" in doc]
    assert len(files) == 1, "the monitoring page shows one rule file"
    return [rule for group in files[0]["groups"] for rule in group["rules"]]


def test_importable_with_a_datasource_input_and_variables():
    d = dashboard()
    assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"]
    assert d["__inputs"][0]["pluginId"] == "prometheus" and d["__inputs"][0]["type"] == "datasource"
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    assert [v["name"] for v in d["templating"]["list"]] == ["instance", "pool"]
    for p in panels():
        assert p["datasource"]["uid"] == DS and all(t["datasource"]["uid"] == DS for t in p["targets"]), p["title"]
        assert p["targets"] and p["description"], p["title"]
    for var in d["templating"]["list"]:
        assert var["datasource"]["uid"] == DS
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))


def test_every_expression_parses():
    for where, expr in expressions():
        try:
            assert selectors(grafana_to_promql(expr)), f"{where}: no selector in {expr}"
        except ValueError as exc:
            pytest.fail(f"{where}: {exc}: {expr}")


def test_kvtier_metrics_are_real_and_filtered_by_the_variables():
    series = kvtier_series()
    used = set()
    for where, expr in expressions():
        for sel in selectors(grafana_to_promql(expr)):
            name = metric_name(sel)
            if not name.startswith("kvtier_"):
                continue
            used.add(name)
            assert name in series, f"{where}: {name} is not a series the exporter emits"
            labels = matchers(sel)
            assert set(labels) <= set(series[name]) | SCRAPE_LABELS, f"{where}: {name} has no label {set(labels)}"
            if where.startswith("panel"):
                assert labels.get("instance") == "var_instance", f"{where}: {name} not filtered by $instance"
                if "pool" in series[name]:
                    assert labels.get("pool") == "var_pool", f"{where}: {name} not filtered by $pool"
    # The panels the dashboard is for: hits, bandwidth, latency, usage per writer, breakers, boundary errors.
    assert {"kvtier_store_get_hits", "kvtier_store_bytes_read", "kvtier_store_bytes_written",
            "kvtier_read_batch_latency_seconds", "kvtier_writer_bytes_used", "kvtier_device_breaker_state",
            "kvtier_boundary_errors"} <= used


def test_sglang_metrics_are_real():
    known = sglang_metrics()
    samples = {sample for family in known.values() for sample in family}
    used = set()
    for where, expr in expressions():
        for sel in selectors(grafana_to_promql(expr)):
            name = metric_name(sel)
            if name.startswith("kvtier_"):
                continue
            used.add(name)
            assert name in samples, f"{where}: {name} is not a series the installed SGLang exposes"
    assert "sglang:cached_tokens_total" in used  # hit tokens by tier


def test_alert_examples_use_real_series():
    rules = alert_rules()
    assert rules
    series = kvtier_series()
    known = sglang_metrics()
    samples = {sample for family in known.values() for sample in family}
    for rule in rules:
        assert rule["alert"] and rule["annotations"]["summary"]
        for sel in selectors(rule["expr"]):
            name = metric_name(sel)
            if name.startswith("kvtier_"):
                assert name in series, f"{rule['alert']}: {name}"
                assert set(matchers(sel)) <= set(series[name]) | SCRAPE_LABELS, f"{rule['alert']}: {name}"
            else:
                assert name in samples, f"{rule['alert']}: {name}"


def test_the_page_describes_every_panel():
    page = hooks().dashboard()
    for p in panels():
        assert f"| {p['title']} |" in page
    rows = [p["title"] for p in dashboard()["panels"] if p["type"] == "row"]
    assert [line[4:] for line in page.splitlines() if line.startswith("### ")] == rows
