"""MkDocs hooks: the reference pages generated from the package's own definitions.

A page holds a marker, ``<!-- kvtier:NAME -->`` alone on a line, which ``on_page_markdown`` replaces with the
Markdown that ``GENERATORS[NAME]`` renders:

- ``configuration``: every store key from ``StoreConfig``'s fields (their ``metadata["doc"]``, types and
  defaults), enum members with their meanings (``DocumentedEnum``), the ``throttle`` / ``fault_injection``
  tables from their spec dataclasses, and the keys SGLang itself reads from the same extra config;
- ``metrics``: every ``kvtier_`` series, read off a real ``Exporter`` over a private registry (name, type, help)
  with its labels;
- ``cli``: every ``sgl-kvtier`` sub-command, read off ``cli.build_parser()``;
- ``dashboard``: the panels of the Grafana dashboard (``dashboards/sgl-kvtier.json``), row by row.

An unknown marker, a key or member without documentation, or a series in no section fails the build. The hooks'
own files are taken out of the site (``on_files``). The tests import this module by path, as MkDocs does.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import html
import json
import math
import re
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

from sgl_kvtier import cli
from sgl_kvtier.config import DOC, FaultSpec, StoreConfig, ThrottleSpec
from sgl_kvtier.telemetry import prometheus

MARKER = re.compile(r"^<!--\s*kvtier:([a-z-]+)\s*-->\s*$", re.MULTILINE)
HERE = Path(__file__).resolve().parent

# The tables of StoreConfig: key -> the spec dataclass that parses it (config.StoreConfig.throttle_spec, fault_spec).
TABLES: dict[str, type[Any]] = {"throttle": ThrottleSpec, "fault_injection": FaultSpec}

# Keys of the extra config that SGLang reads itself (sgl_kvtier.sglang.settings.SGLANG_KEYS: ignored by our
# backend). What each does, from SGLang 0.5.23's source (the file and reader named). The tests check these keys
# against SGLANG_KEYS.
SGLANG_KEY_DOCS = {
    "backend_name": "Name of the dynamic backend (`kvtier`); required with `--hicache-storage-backend dynamic` "
                    "(`mem_cache/storage/backend_factory.py`).",
    "module_path": "Module the dynamic backend is imported from (`sgl_kvtier.sglang`); required.",
    "class_name": "Class of the dynamic backend in that module (`KVTierStorage`); required.",
    "interface_v1": "`1`: SGLang moves pages with the zero-copy page interface (`batch_get_v1` / `batch_set_v1`) "
                    "that sgl-kvtier implements (`managers/cache_controller.py`).",
    "hicache_storage_pass_prefix_keys": "`true`: SGLang passes the keys of the pages before each batch, so the "
                                        "backend knows the parent of a batch's first page (the prefix chains of "
                                        "`eviction = \"chain\"`) and where a hit starts (the cost policy). "
                                        "Default `false` in SGLang (`hybrid_cache/hybrid_cache_controller.py`).",
    "prefetch_threshold": "Smallest L3 hit, in tokens, that SGLang prefetches (default 256; at least a page).",
    "prefetch_timeout_base": "Seconds of SGLang's prefetch time budget before the per-token part (default 1; "
                             "with `--hicache-storage-prefetch-policy timeout`).",
    "prefetch_timeout_per_ki_token": "Seconds of SGLang's prefetch time budget per 1024 tokens of the hit "
                                     "(default 0.25).",
    "tp_lcm_size": "Least common multiple of the TP sizes of servers sharing a store with different TP sizes "
                   "(`page_head` layouts split heads by it; `managers/cache_controller.py`).",
    "allocator": "`shm`: SGLang allocates the host pool in shared memory (`mem_cache/pool_host/common.py`).",
    "file_storage_path": "Directory of SGLang's own `file` backend; not read by sgl-kvtier.",
    "extra_backend_tag": "A tag some of SGLang's own backends add to their keys; not read by sgl-kvtier.",
}


def _settings_keys() -> frozenset[str]:
    from sgl_kvtier.sglang.settings import SGLANG_KEYS  # imports torch: only where the page is built

    return SGLANG_KEYS


# ------------------------------------------------------------------------------------------------ configuration
def _kind(tp: Any) -> str:
    """A field type as an operator writes it in TOML / JSON."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) < len(typing.get_args(tp)):
        return f"{_kind(args[0])}, optional"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "string"
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"list of {_kind(typing.get_args(tp)[0])}s"
    if origin is dict:
        return "table"
    names = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if tp in names:
        return names[tp]
    raise PluginError(f"no TOML kind for the config type {tp!r}")


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return ""


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING:
        return "required"
    value = f.default
    if value is None:
        return "absent (null)"
    if isinstance(value, enum.Enum):
        return f'`"{value.value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and math.isinf(value):
        return "uncapped"
    if isinstance(value, tuple):
        return f"`{list(value)}`"
    if isinstance(value, int) and f.name.endswith("bytes") and _human_bytes(value):
        return f"`{value}` ({_human_bytes(value)})"
    return f"`{value!r}`"


def field_doc(f: dataclasses.Field[Any]) -> str:
    """A field's documentation (``""``: none)."""
    return str(f.metadata.get(DOC, "")).strip()


def member_doc(member: enum.Enum) -> str:
    """An enum member's own meaning (``""``: none, or only its class's docstring)."""
    text = member.__doc__ or ""
    return "" if text == type(member).__doc__ else text.strip()


def _key_section(f: dataclasses.Field[Any], tp: Any, prefix: str = "") -> list[str]:
    text = field_doc(f)
    if not text:
        raise PluginError(f"config key {prefix}{f.name} has no documentation (metadata['doc'])")
    lines = [f"### `{prefix}{f.name}`", "", html.escape(text, quote=False), "", f"- Type: {_kind(tp)}", f"- Default: {_default(f)}"]
    enum_type = next((a for a in (tp, *typing.get_args(tp)) if isinstance(a, type) and issubclass(a, enum.Enum)), None)
    if enum_type is not None:
        lines.append("- Values:")
        for member in enum_type:
            meaning = member_doc(member)
            if not meaning:
                raise PluginError(f"{enum_type.__name__}.{member.name} has no meaning (DocumentedEnum)")
            lines.append(f'    - `"{member.value}"`: {html.escape(meaning, quote=False)}')
    if f.name in TABLES and not prefix:
        lines.append(f"- Keys: see [`{f.name}` keys](#{f.name}-keys)")
    return [*lines, ""]


def _keys(cls: type[Any], prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        out += _key_section(f, hints[f.name], prefix)
    return out


def _summary(cls: type[Any]) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default |", "| --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        rows.append(f"| [`{f.name}`](#{f.name}) | {_kind(hints[f.name])} | {_default(f)} |")
    return [*rows, ""]


def configuration() -> str:
    """The configuration reference: store keys, their tables, SGLang's keys."""
    dict_fields = {f.name for f in dataclasses.fields(StoreConfig) if _kind(typing.get_type_hints(StoreConfig)[f.name])
                   .startswith("table")}
    if dict_fields != set(TABLES):
        raise PluginError(f"StoreConfig's tables {sorted(dict_fields)} are not the documented ones {sorted(TABLES)}")
    lines = ["## Store keys", "", "Every key of the `[kvtier]` table (or of the extra-config JSON) at a glance:", "",
             *_summary(StoreConfig), *_keys(StoreConfig)]
    for name, spec in TABLES.items():
        lines += [f"## `{name}` keys", "", _md((spec.__doc__ or "").strip().splitlines()[0]), "",
                  *_keys(spec, f"{name}.")]
    keys = _settings_keys()
    missing = sorted(keys - set(SGLANG_KEY_DOCS))
    if missing:
        raise PluginError(f"SGLang's extra-config keys {missing} have no documentation (SGLANG_KEY_DOCS)")
    from sgl_kvtier.serving.launch import BACKEND, SGLANG_EXTRA_KEYS

    lines += ["## Keys SGLang reads", "",
              "The same extra config carries SGLang's own keys; sgl-kvtier ignores them, any other unknown key stops "
              "start-up naming it. `sgl-kvtier launch` sets the backend's keys itself, and passes the prefetch keys "
              "through from its `[sglang]` table.", "",
              "| key | set by `sgl-kvtier launch` | meaning |", "| --- | --- | --- |"]
    for key in sorted(keys):
        if key in BACKEND:
            launch = f"`{json.dumps(BACKEND[key])}`"
        else:
            launch = "from `[sglang]`" if key in SGLANG_EXTRA_KEYS else "no"
        lines.append(f"| `{key}` | {launch} | {SGLANG_KEY_DOCS[key]} |")
    return "\n".join([*lines, ""])


# ------------------------------------------------------------------------------------------------------ metrics
# Sections of the metrics reference: title, the series (names without kvtier_) it takes, what they describe.
METRIC_SECTIONS: tuple[tuple[str, Callable[[str], bool], str], ...] = (
    ("Store read model", lambda n: n.startswith("read_"),
     "The read model fitted on the pool's read batches (seconds = batch latency + bytes / bandwidth); the cost "
     "policy's inputs. No series until the first batch was measured."),
    ("Devices", lambda n: n.startswith("device_"),
     "Per device of the pool's store: its own read model and its circuit breaker."),
    ("Store", lambda n: n.startswith("store_"),
     "The pool's store: occupancy, and its running totals since it opened."),
    ("Read-ahead", lambda n: n.startswith("readahead_"),
     "Read-ahead staging (`readahead_bytes` above 0): pages through the staging area since the store opened."),
    ("Shared pool", lambda n: n.startswith("pool_"),
     "The namespace's pool over all of its writers: what its cap counts, writers by state, and the sharing "
     "counters."),
    ("Writers", lambda n: n.startswith("writer_"),
     "Per writer of the pool (this process's own and every other one it follows). A writer gone from the pool "
     "shows `retired` (live 0, no pages) for a minute, then keeps those values until the process restarts."),
    ("Cost policy", lambda n: n.startswith(("prefill_", "cost_policy_")),
     "The load-or-recompute policy (`KVTIER_PREFETCH_POLICY=cost`): its switch and the prefill model it "
     "compares loads with."),
    ("Caught exceptions", lambda n: n.startswith("boundary_"),
     "Exceptions the adapter caught where it returns to SGLang, served as misses."),
    ("Streamed tails", lambda n: n.startswith("stream"),
     "Streamed L3 tails (`streaming = \"on\"`): series other than `kvtier_streaming_enabled` exist only while "
     "the backend streams."),
)


class Series(typing.NamedTuple):
    """One series the exporter can emit, as its registry describes it."""

    name: str
    type: str
    help: str
    labels: tuple[str, ...]


def exporter_series() -> list[Series]:
    """Every series of a real ``prometheus.Exporter`` (over a private registry), in its declaration order."""
    from prometheus_client import CollectorRegistry

    exporter = prometheus.Exporter(CollectorRegistry())
    out = []
    for gauge in exporter.gauges.values():
        (family,) = gauge.describe()
        out.append(Series(family.name, family.type, family.documentation, tuple(gauge._labelnames)))
    return out


def _labels(labels: Iterable[str]) -> str:
    names = list(labels)
    if all(r in names for r in prometheus.RANKS):
        first = names.index(prometheus.RANKS[0])
        names = [n for n in names if n not in prometheus.RANKS]
        names.insert(first, "ranks")
    return ", ".join(f"`{n}`" for n in names)


def metrics() -> str:
    """The metrics reference: every ``kvtier_`` series by section, then its labels."""
    series = exporter_series()
    placed: dict[str, list[Series]] = {title: [] for title, _, _ in METRIC_SECTIONS}
    for s in series:
        if not s.help.strip():
            raise PluginError(f"series {s.name} has no help text")
        short = s.name.removeprefix("kvtier_")
        title = next((t for t, takes, _ in METRIC_SECTIONS if takes(short)), None)
        if title is None:
            raise PluginError(f"series {s.name} belongs to no section of the metrics reference (METRIC_SECTIONS)")
        placed[title].append(s)
    lines: list[str] = []
    for title, _, intro in METRIC_SECTIONS:
        if not placed[title]:
            raise PluginError(f"the metrics section {title!r} has no series")
        lines += [f"## {title}", "", intro, "", "| series | type | labels | meaning |", "| --- | --- | --- | --- |"]
        lines += [f"| `{s.name}` | {s.type} | {_labels(s.labels)} | {html.escape(s.help, quote=False).replace('|', '&#124;')} |"
                  for s in placed[title]]
        lines.append("")
    used = sorted({label for s in series for label in s.labels})
    missing = [label for label in used if not prometheus.LABEL_HELP.get(label)]
    if missing:
        raise PluginError(f"labels {missing} have no description (prometheus.LABEL_HELP)")
    lines += ["## Labels", "", "`ranks` above stands for `tp_rank`, `pp_rank` and `dp_rank`.", "",
              "| label | meaning |", "| --- | --- |", *(f"| `{label}` | {html.escape(prometheus.LABEL_HELP[label], quote=False)} |" for label in used)]
    return "\n".join([*lines, ""])


# ---------------------------------------------------------------------------------------------------------- cli
WIDTH = 100  # usage lines wrap here whatever the terminal


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each sub-command, in the order they were added."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
    return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]


def _md(text: str) -> str:
    """A docstring's reST literals as Markdown code spans, its lines joined into paragraphs."""
    paragraphs = [" ".join(line.strip() for line in block.splitlines()) for block in re.split(r"\n\s*\n", text.strip())]
    return "\n\n".join(p.replace("``", "`") for p in paragraphs)


def _argument(action: argparse.Action) -> tuple[str, str, str]:
    if action.option_strings:
        name = ", ".join(action.option_strings)
        if action.nargs != 0:
            name += f" {action.metavar or action.dest.upper()}"
    else:
        name = str(action.metavar or action.dest)
        if action.nargs in ("+", "*"):
            name += " ..."
    if action.required and action.option_strings:
        default = "required"
    elif action.option_strings and action.nargs == 0:
        default = "off"
    elif action.default is None or action.default is argparse.SUPPRESS:
        default = "" if not action.option_strings else "none"
    else:
        default = f"`{action.default}`"
    return f"`{name}`", default, html.escape(action.help or "—", quote=False).replace("|", "&#124;")


def cli_reference() -> str:
    """The command-line reference: per sub-command its summary, what it does, usage and arguments."""
    parser = cli.build_parser()
    lines: list[str] = []
    for name, summary, sub in _subcommands(parser):
        sub.formatter_class = functools.partial(argparse.HelpFormatter, width=WIDTH)
        func = sub.get_default("func")
        lines += [f"## `{name}`", "", f"{summary[:1].upper()}{summary[1:]}." if summary else "", ""]
        if func is not None and func.__doc__:
            lines += [_md(func.__doc__), ""]
        lines += ["```text", sub.format_usage().strip(), "```", "", "| argument | default | description |",
                  "| --- | --- | --- |"]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            lines.append("| {} | {} | {} |".format(*_argument(action)))
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- dashboard
DASHBOARD = HERE.parent / "dashboards" / "sgl-kvtier.json"


def dashboard() -> str:
    """The Grafana dashboard's panels, row by row: title and description, read off its JSON."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    lines: list[str] = []
    for panel in panels:
        if panel["type"] == "row":
            lines += ["", f"### {panel['title']}", "", "| panel | what it shows |", "| --- | --- |"]
            continue
        if not panel.get("description"):
            raise PluginError(f"dashboard panel {panel['title']!r} has no description")
        lines.append(f"| {panel['title']} | {html.escape(panel['description'], quote=False)} |")
    return "\n".join([*lines, ""])


GENERATORS: dict[str, Callable[[], str]] = {"configuration": configuration, "metrics": metrics, "cli": cli_reference,
                                             "dashboard": dashboard}


# -------------------------------------------------------------------------------------------------------- hooks
def on_files(files: Any, config: Any) -> Any:
    """Keep the hooks' own files (this module, its bytecode) out of the site."""
    for file in list(files):
        if file.src_uri == "hooks.py" or file.src_uri.startswith("__pycache__/"):
            files.remove(file)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each ``<!-- kvtier:NAME -->`` line with what ``GENERATORS[NAME]`` renders."""
    def expand(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise PluginError(f"{page.file.src_uri}: unknown marker kvtier:{name} (known: {', '.join(GENERATORS)})")
        return GENERATORS[name]()

    return MARKER.sub(expand, markdown)


__all__ = ["DASHBOARD", "GENERATORS", "METRIC_SECTIONS", "SGLANG_KEY_DOCS", "TABLES", "Series", "cli_reference",
           "configuration", "dashboard", "exporter_series", "field_doc", "member_doc", "metrics", "on_files", "on_page_markdown"]
