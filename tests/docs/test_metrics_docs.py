"""The metrics reference: every series the exporter defines has help text that says what it counts, every label
a meaning, and the generated page lists them all; the SGLang metrics the pages name exist in the installed SGLang."""

from __future__ import annotations

import dataclasses
import re

import pytest
from docs_support import DOCS, hooks, kvtier_series, sglang_metrics

from sgl_kvtier.prefetch import ReadAheadCounters
from sgl_kvtier.telemetry import prometheus
from sgl_kvtier.telemetry.counters import StoreCounters
from sgl_kvtier.telemetry.snapshot import StreamHookSnapshot, StreamSnapshot


def test_every_series_has_help_text():
    series = hooks().exporter_series()
    assert {s.name for s in series} == set(kvtier_series())
    assert len(series) == len(prometheus._GAUGES)
    bare = [s.name for s in series if not s.help.strip()]
    assert not bare, f"series without help text: {bare}"
    assert all(s.type == "gauge" and s.name.startswith("kvtier_") for s in series)


def test_running_totals_say_what_they_count():
    """The counter families' help comes from a meaning per field, never from the field's name alone."""
    assert set(prometheus.STORE_HELP) == {f.name for f in dataclasses.fields(StoreCounters)}
    assert set(prometheus.READAHEAD_HELP) == {f.name for f in dataclasses.fields(ReadAheadCounters)}
    streamed = set(prometheus.STREAM_READS) | set(prometheus.STREAM_HOOKS)
    assert set(prometheus.STREAM_HELP) == streamed
    assert streamed == ({f.name for f in dataclasses.fields(StreamSnapshot)} - {"hooks", "bind"}) | (
        {f.name for f in dataclasses.fields(StreamHookSnapshot)} - {"dropped", "not_streamed"})
    helps = {name: text for name, text, _ in prometheus._GAUGES}
    for field in prometheus.COUNTERS:
        assert helps[f"store_{field}"].startswith(prometheus.STORE_HELP[field])
    for table in (prometheus.STORE_HELP, prometheus.READAHEAD_HELP, prometheus.STREAM_HELP):
        for field, text in table.items():
            assert text.strip() and text.lower() != field.replace("_", " "), (field, text)
            assert "_" not in field or field not in text, (field, text)  # a meaning, not the identifier


def test_every_label_has_a_meaning():
    used = {label for labels in kvtier_series().values() for label in labels}
    assert used <= set(prometheus.LABEL_HELP)
    assert all(prometheus.LABEL_HELP[label].strip() for label in used)


def test_the_page_lists_every_series_in_one_section():
    page = hooks().metrics()
    for name, labels in kvtier_series().items():
        rows = [line for line in page.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1, name
        assert "| gauge |" in rows[0]
        for label in labels:
            assert f"`{label}`" in rows[0] or (label in prometheus.RANKS and "`ranks`" in rows[0]), (name, label)
    titles = [title for title, _, _ in hooks().METRIC_SECTIONS]
    assert [line[3:] for line in page.splitlines() if line.startswith("## ")] == [*titles, "Labels"]


def test_a_series_in_no_section_fails_the_page(monkeypatch):
    from mkdocs.exceptions import PluginError

    h = hooks()
    monkeypatch.setattr(h, "METRIC_SECTIONS", h.METRIC_SECTIONS[:-1])  # streamed tails' section gone
    with pytest.raises(PluginError, match="kvtier_stream.* belongs to no section"):
        h.metrics()


@pytest.mark.parametrize("page", ["reference/metrics.md", "operations/monitoring.md"])
def test_sglang_metrics_named_in_the_pages_exist(page):
    text = (DOCS / page).read_text()
    named = set(re.findall(r"sglang:[a-z_:]+[a-z]", text))
    assert named, f"{page} names no SGLang metric"
    known = sglang_metrics()
    samples = {sample for family in known.values() for sample in family}
    unknown = sorted(n for n in named if n not in known and n not in samples)
    assert not unknown, f"{page} names metrics the installed SGLang does not define: {unknown}"
