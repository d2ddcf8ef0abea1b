"""The command-line reference lists every sub-command and argument of the real parser; the environment page
documents exactly the ``KVTIER_*`` variables the package reads."""

from __future__ import annotations

import argparse
import ast
import re

import pytest
from docs_support import DOCS, ROOT, hooks

from sgl_kvtier import cli

VARIABLE = re.compile(r"(?<![A-Za-z0-9_])KVTIER_[A-Z0-9]+(?:_[A-Z0-9]+)*")


def subparsers() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_subcommand_and_argument_is_on_the_page():
    page = hooks().cli_reference()
    subs = subparsers()
    assert set(subs) == {"inspect", "fsck", "check-shared", "pool-format", "demo", "launch", "plan", "verify"}
    sections = dict(re.findall(r"^## `([a-z-]+)`\n(.*?)(?=^## |\Z)", page, re.S | re.M))
    assert list(sections) == list(subs)
    for name, sub in subs.items():
        section = sections[name]
        assert f"usage: sgl-kvtier {name}" in section
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            shown = ", ".join(action.option_strings) if action.option_strings else (action.metavar or action.dest)
            row = next((line for line in section.splitlines() if line.startswith(f"| `{shown}")), None)
            assert row is not None, f"{name}: {shown} missing"
            if action.help:
                assert action.help in row
            if action.required and action.option_strings:
                assert "| required |" in row


def read_variables() -> dict[str, list[str]]:
    """Every ``KVTIER_*`` name in the package's string constants (its reads, and the docstrings saying so)
    -> the files that name it."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "sgl_kvtier").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in VARIABLE.findall(node.value):
                    found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def documented(text: str) -> set[str]:
    return set(re.findall(r"^\| `(KVTIER_[A-Z0-9_]+)` \|", text, re.M))


def test_the_environment_page_documents_every_variable_read():
    read = read_variables()
    assert {"KVTIER_PREFETCH_POLICY", "KVTIER_METRICS_INTERVAL_S", "KVTIER_STREAM"} <= set(read)  # the scan works
    page = (DOCS / "reference" / "environment.md").read_text()
    rows = documented(page)
    missing = {name: files for name, files in read.items() if name not in rows}
    assert not missing, f"read by the package, not on docs/reference/environment.md: {missing}"
    assert not rows - set(read), f"documented but never read: {sorted(rows - set(read))}"


def test_test_only_variables_are_apart():
    page = (DOCS / "reference" / "environment.md").read_text()
    head, sep, tests = page.partition("\n## For tests\n")
    assert sep, "the page has a section for tests"
    tests = tests.split("\n## ", 1)[0]
    assert {name for name in documented(page) if "_TEST_" in name} <= documented(tests)
    assert not documented(head) & documented(tests)


@pytest.mark.parametrize("name", ["KVTIER_METRICS_INTERVAL_S", "KVTIER_GIL_SWITCH_US", "KVTIER_PROBE_CACHE"])
def test_documented_defaults_match_the_code(name):
    from sgl_kvtier.io import priority, probe
    from sgl_kvtier.telemetry import prometheus

    row = next(line for line in (DOCS / "reference" / "environment.md").read_text().splitlines()
               if line.startswith(f"| `{name}` |"))
    if name == "KVTIER_METRICS_INTERVAL_S":
        assert prometheus.ENV_INTERVAL == name and f"| `{prometheus.DEFAULT_INTERVAL_S:g}` |" in row
    elif name == "KVTIER_GIL_SWITCH_US":
        assert priority.SWITCH_ENV == name and f"{priority.MIN_SWITCH_US} to {priority.MAX_SWITCH_US}" in row
    else:
        assert probe.CACHE_ENV == name and "sgl-kvtier/probe.json" in row
