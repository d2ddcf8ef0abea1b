"""What the documentation tests share: the MkDocs hooks module (imported by path, as MkDocs does), the series
the exporter really emits, the metric names the installed SGLang defines, and PromQL selectors."""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HOOKS = DOCS / "hooks.py"
DASHBOARD = ROOT / "dashboards" / "sgl-kvtier.json"
# Series a scrape adds to every target, whatever it exposes.
SCRAPE_LABELS = frozenset({"instance", "job"})


@functools.cache
def hooks() -> ModuleType:
    """``docs/hooks.py``, loaded by path under the name MkDocs gives it."""
    spec = importlib.util.spec_from_file_location("kvtier_docs_hooks", HOOKS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def kvtier_series() -> dict[str, tuple[str, ...]]:
    """Every ``kvtier_`` series a real exporter defines (over a private registry) -> its label names."""
    from prometheus_client import CollectorRegistry

    from sgl_kvtier.telemetry.prometheus import Exporter

    out = {}
    for gauge in Exporter(CollectorRegistry()).gauges.values():
        (family,) = gauge.describe()
        out[family.name] = tuple(gauge._labelnames)
    return out


_SUFFIXES = {"Counter": ("_total", "_created"), "Gauge": ("",), "Histogram": ("_bucket", "_sum", "_count", "_created"),
             "Summary": ("_sum", "_count", "_created")}


@functools.cache
def sglang_metrics() -> dict[str, frozenset[str]]:
    """The installed SGLang's metric families (``sglang:...``) -> the sample names a scrape shows of each, from
    every ``Counter`` / ``Gauge`` / ``Histogram`` / ``Summary`` call in its observability package's source
    (read, not imported). Skips the test where SGLang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SGLang is not installed")
    package = Path(next(iter(spec.submodule_search_locations))) / "srt" / "observability"
    out: dict[str, frozenset[str]] = {}
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            kind = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            name = next((k.value.value for k in node.keywords if k.arg == "name" and isinstance(k.value, ast.Constant)
                         and isinstance(k.value.value, str)), None)
            if kind not in _SUFFIXES or name is None or not name.startswith("sglang:"):
                continue
            base = name.removesuffix("_total") if kind == "Counter" else name
            out[name] = frozenset(base + suffix for suffix in _SUFFIXES[kind])
    assert "sglang:cached_tokens_total" in out, f"no SGLang metric definitions found under {package}"
    return out


GRAFANA_RANGE = re.compile(r"\$__rate_interval|\$__interval|\$__range|\$\{__rate_interval\}")
GRAFANA_VARIABLE = re.compile(r"\$\{?(\w+)\}?")


def grafana_to_promql(expr: str) -> str:
    """A dashboard expression as plain PromQL: its ranges and variables replaced by values of their kind."""
    return GRAFANA_VARIABLE.sub(lambda m: f"var_{m.group(1)}", GRAFANA_RANGE.sub("5m", expr))


def selectors(expr: str) -> list[Any]:
    """The vector selectors of a PromQL expression (``ValueError`` where it does not parse)."""
    import promql_parser

    found: list[Any] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def metric_name(selector: Any) -> str:
    """A selector's metric name (its ``__name__`` matcher where it has no name of its own)."""
    if selector.name:
        return str(selector.name)
    names = [m.value for m in selector.matchers.matchers if m.name == "__name__"]
    assert names, f"a selector without a metric name: {selector}"
    return str(names[0])


def matchers(selector: Any) -> dict[str, str]:
    """A selector's label matchers: label -> value."""
    return {m.name: m.value for m in selector.matchers.matchers if m.name != "__name__"}
