"""Every log line of the package at WARNING or above is documented in docs/operations/log-messages.md.

The calls are found with ``ast``: ``.warning`` / ``.warn`` / ``.error`` / ``.exception`` / ``.critical`` /
``.fatal`` on a logger (``log``, ``logger``, ``self._errlog``, ``self._logs[kind]``, ``logging``...),
``.log(level, ...)`` unless ``level`` is DEBUG or INFO, and ``warnings.warn``. A message passed through a
helper's parameter (``_warn_once(name, msg, ...)``) is followed to the helper's callers in the same module.

Each message becomes a template: its literal text, whitespace collapsed, with every placeholder (``%s``,
``%.1f``, an f-string field, a ``{}`` of ``.format``) a gap. A template of at least ``MIN_WORDS`` words (of
two letters or more) must appear on the page in order, each gap filled by at most ``GAP_CHARS`` characters
(``<path>``, ``'<model>'``). A message with fewer words (``"%s: %s"``), or one that cannot be followed to a
string, must instead have its call site, ``sgl_kvtier.<module>:<function>``, written on the page; a call
site never stands for a longer message's text.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sgl_kvtier"
PAGE = ROOT / "docs" / "operations" / "log-messages.md"

LEVEL_METHODS = {"warning", "warn", "error", "exception", "critical", "fatal"}
QUIET_LEVELS = {"DEBUG", "INFO", "NOTSET"}
LOGGER_NAME = re.compile(r"_*(?:\w+_)?(?:log|logs|logger|errlog)|logging")
PLACEHOLDER = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa]")
BRACES = re.compile(r"\{[^{}]*\}")
GAP = "\x00"  # a placeholder in a template
MIN_WORDS = 3  # literal words a template needs to be looked up by its text
GAP_CHARS = 80  # the most characters the page may show for one placeholder


@dataclass(frozen=True)
class LogCall:
    """One WARNING-or-above log call: where it is, and its message templates (None: not a string)."""

    module: str  # dotted, e.g. sgl_kvtier.store.health (a package: sgl_kvtier.sglang.plugins)
    function: str
    line: int
    templates: tuple[str, ...] | None

    @property
    def site(self) -> str:
        return f"{self.module}:{self.function}"


def _callee_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _receiver_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Subscript):  # self._logs[kind]
        node = node.value
    return _callee_name(node)


def _level_is_quiet(level: ast.expr) -> bool:
    """Whether a ``.log(level, ...)`` level is known to be below WARNING (a variable: not known)."""
    if isinstance(level, ast.Constant) and isinstance(level.value, int):
        return level.value < 30
    name = _callee_name(level)
    return name in QUIET_LEVELS


def _message_arg(call: ast.Call) -> ast.expr | None:
    """The message argument of a log call, or None where this call is not one (see the module docstring)."""
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    receiver = _receiver_name(func.value)
    if func.attr == "warn" and receiver == "warnings":
        return call.args[0] if call.args else None
    if receiver is None or not LOGGER_NAME.fullmatch(receiver):
        return None
    if func.attr in LEVEL_METHODS:
        return call.args[0] if call.args else None
    if func.attr == "log" and len(call.args) >= 2 and not _level_is_quiet(call.args[0]):
        return call.args[1]
    return None


class _Module:
    """One source file: its functions, each node's enclosing function, and the templates of an expression."""

    def __init__(self, path: Path):
        parts = path.relative_to(ROOT).with_suffix("").parts
        self.name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        self.tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        self.enclosing: dict[ast.AST, ast.FunctionDef | ast.AsyncFunctionDef | None] = {}
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self._walk(self.tree, None)

    def _walk(self, node: ast.AST, function: ast.FunctionDef | ast.AsyncFunctionDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            self.enclosing[child] = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(child.name, []).append(child)
                self._walk(child, child)
            else:
                self._walk(child, function)

    def calls(self) -> Iterator[LogCall]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                message = _message_arg(node)
                if message is not None:
                    function = self.enclosing.get(node)
                    yield LogCall(self.name, function.name if function else "<module>", node.lineno,
                                  self.templates(message, function, frozenset()))

    def templates(self, node: ast.expr, function: ast.FunctionDef | ast.AsyncFunctionDef | None,
                  seen: frozenset[tuple[str, str]]) -> tuple[str, ...] | None:
        """The templates ``node`` may evaluate to, or None where one of them is not known."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return (_percent(node.value),)
        if isinstance(node, ast.JoinedStr):
            return ("".join(v.value if isinstance(v, ast.Constant) else GAP for v in node.values),)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            return self.templates(node.left, function, seen)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.templates(node.left, function, seen), self.templates(node.right, function, seen)
            if left is None or right is None:
                return None
            return tuple(a + b for a in left for b in right)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format" \
                and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str):
            return (BRACES.sub(GAP, node.func.value.value),)
        if isinstance(node, ast.Name) and function is not None:
            return self._through_parameter(node.id, function, seen)
        return None

    def _through_parameter(self, name: str, function: ast.FunctionDef | ast.AsyncFunctionDef,
                           seen: frozenset[tuple[str, str]]) -> tuple[str, ...] | None:
        """A message that is parameter ``name`` of ``function``: what the callers in this module pass."""
        params = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
        if name not in params or (function.name, name) in seen:
            return None
        seen = seen | {(function.name, name)}
        method = bool(params) and params[0] in ("self", "cls")
        found: list[str] = []
        callers = 0
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Call) or _callee_name(node.func) != function.name:
                continue
            index = params.index(name) - (1 if method and isinstance(node.func, ast.Attribute) else 0)
            arg = next((k.value for k in node.keywords if k.arg == name), None)
            if arg is None and 0 <= index < len(node.args) and not isinstance(node.args[index], ast.Starred):
                arg = node.args[index]
            if arg is None:
                continue
            got = self.templates(arg, self.enclosing.get(node), seen)
            if got is None:
                continue  # (the pass-through itself, or a caller passing a variable on: that caller is checked)
            callers += 1
            found += got
        return tuple(found) if callers else None


def _percent(text: str) -> str:
    """``text`` as %-formatting reads it: each conversion a gap, ``%%`` a ``%``."""
    return PLACEHOLDER.sub(GAP, text.replace("%%", "\x01")).replace("\x01", "%")


def _squash(text: str) -> str:
    return " ".join(text.split())


def words(template: str) -> int:
    return len(re.findall(r"[A-Za-z]{2,}", template.replace(GAP, " ")))


def pattern(template: str) -> re.Pattern[str]:
    """The page text a template matches: its literal pieces in order (whitespace collapsed, as ``undocumented``
    collapses the page's), each gap at most ``GAP_CHARS`` characters."""
    pieces = [re.escape(_squash(p)) for p in template.split(GAP)]
    return re.compile(rf".{{0,{GAP_CHARS}}}?".join(pieces))


@functools.cache
def log_calls() -> tuple[LogCall, ...]:
    calls: list[LogCall] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        calls += _Module(path).calls()
    return tuple(calls)


def undocumented(calls: Iterable[LogCall], page: str) -> list[str]:
    """A line per message not on ``page`` (see the module docstring)."""
    text = _squash(page)
    missing = []
    for call in calls:
        if call.templates is None or any(words(t) < MIN_WORDS for t in call.templates):
            if call.site not in text:
                missing.append(f"{call.site} (line {call.line}): a message too short to look up: write its call site")
        for template in call.templates or ():
            if words(template) >= MIN_WORDS and not pattern(template).search(text):
                shown = template.replace(GAP, "<...>")
                missing.append(f"{call.site} (line {call.line}): {shown!r}")
    return missing


# ---------------------------------------------------------------------------------------------- tests
def test_every_warning_and_error_is_documented():
    missing = undocumented(log_calls(), PAGE.read_text(encoding="utf-8"))
    assert not missing, f"{len(missing)} log messages not in {PAGE.relative_to(ROOT)}:\n" + "\n".join(missing)


def test_the_scan_finds_the_package_log_calls():
    calls = log_calls()
    sites = {c.site for c in calls}
    assert len(calls) >= 40, len(calls)
    assert {"sgl_kvtier.store.health:_note", "sgl_kvtier.telemetry.counters:fail"} <= sites, sorted(sites)
    assert all(c.templates for c in calls if c.site == "sgl_kvtier.io.priority:_warn_once"), "helper not followed"
    assert not any(c.module == "sgl_kvtier.io.probe" and c.function == "main" for c in calls), "argparse's error"


def test_matching_is_exact_enough():
    tpl = _percent("device %s: circuit %s")
    assert words(tpl) == 2 and words(_percent("read of slot %d: %s")) == 3
    found = pattern(_percent("%s: lease beat failed: %r"))
    assert found.search(_squash("`<writer dir>: lease beat\n  failed: <error>`"))
    assert not found.search("lease beat failed")  # the ': ' before it is part of the template
    assert not pattern(_percent("write to %s failed: %s")).search("write to " + "x" * 200 + " failed: e")
    assert _percent("100%% of %d") == "100% of " + GAP
    call = LogCall("sgl_kvtier.m", "f", 1, (_percent("%s: %s"),))
    assert undocumented([call], "nothing") and not undocumented([call], "see `sgl_kvtier.m:f`")
    wordy = LogCall("sgl_kvtier.m", "f", 1, (_percent("write to %s failed: %s"),))
    assert undocumented([wordy], "see `sgl_kvtier.m:f`")  # a call site never stands for a message's text
