"""The architecture as docs/design/architecture.md draws it, checked from the source (AST, every import, lazy ones too).

Layers, lowest first; a module imports only from its own package or from packages of a lower layer:

    0  errors
    1  keys, config, estimation,         foundation: plain data, parsing, typed errors, measured models,
       fingerprint                       the weights' identity from the model files
    2  telemetry, io                     counters and snapshots; engines, buffers, engine wrappers
    3  policy                            eviction, admission, the load-or-recompute model and its inputs
    4  store                             one writer's shard: format, slots, journal, index, read and write paths
    5  media                             where slots live beyond a directory: the shared raw device
    6  sharing                           many writers of one pool: writers, leases, liveness, followers, quota,
                                         fencing, retirement, the cluster filesystem checks
    7  admin, prefetch, plan             offline tools (fsck, rebuild); read-ahead staging over a store's reads;
                                         the sizing planner (a trace replayed through the store's own policies)
    8  sglang, serving                   the SGLang adapter; tooling that runs SGLang as a process
    9  experiments, verify               opt-in features behind their plugin switches (streamed tails, the cost
                                         policy's hooks, the layer loader): the adapter never imports them;
                                         the L3 measured on a deployment against baselines (runs servers)
   10  cli                               operator commands (11: ``__main__``, which runs them)

So the shard imports neither media nor sharing: ``PageStore.open`` takes a ``store.site.WriterSite`` that
``sharing.sites.site_for`` chooses once from the config.
Only ``sgl_kvtier.sglang`` and ``sgl_kvtier.experiments`` import ``sglang`` or ``torch``. No import cycles,
also inside a package (a module's edges include the ``__init__`` of every package it imports from, as Python
runs those too). No experiment imports another, except along a listed one-way dependency
(``EXPERIMENT_DEPENDENCIES``): what two need is the adapter's (e.g. ``sglang.prefill_samples``), and one adds
to another's work through a hook point the adapter offers (``storage.Extension``, a batch observer).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {
    "errors": 0, "keys": 1, "config": 1, "estimation": 1, "fingerprint": 1, "telemetry": 2, "io": 2, "policy": 3,
    "store": 4, "media": 5, "sharing": 6, "admin": 7, "prefetch": 7, "plan": 7, "sglang": 8, "serving": 8, "verify": 9, "experiments": 9,
    "cli": 10, "__main__": 11,
}
ADAPTER = ("sglang", "experiments")
ADAPTER_ONLY = {"sglang", "torch", "triton", "vllm", "flashinfer"}
# (importer, imported) -> why: the only imports allowed between experiments, each one-way.
EXPERIMENT_DEPENDENCIES = {
    ("streaming", "layer_loader"): "a streamed tail is copied to the device through the layer loader's per-layer "
                                   "gate (layer_gate.LayerLoad) and SGLang's layer copy (plugin.layer_copier)",
}
MAX_LINES = 450

Modules = dict[str, Path]


def find_modules(root: Path) -> Modules:
    """``{dotted name: path}`` for every module of the ``sgl_kvtier`` package under ``root``."""
    out = {}
    for path in sorted((root / "sgl_kvtier").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(mods: Modules, name: str) -> list[tuple[str, int]]:
    """Every module ``name`` imports (relative imports resolved; ``from pkg import sub`` -> ``pkg.sub``)."""
    path = mods[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in mods else base, node.lineno))
    return found


def top(name: str) -> str:
    return name.split(".")[1] if "." in name else ""


def unlayered(mods: Modules) -> list[str]:
    return sorted({top(m) for m in mods if m != "sgl_kvtier"} - set(LAYERS))


def layer_violations(mods: Modules) -> list[str]:
    bad = []
    for name in mods:
        mine = top(name)
        if mine not in LAYERS:
            continue
        for target, line in imports(mods, name):
            theirs = top(target) if target.startswith("sgl_kvtier.") else None
            if theirs is None or theirs == mine or theirs not in LAYERS:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                bad.append(f"{mods[name]}:{line}: {mine} (layer {LAYERS[mine]}) imports {target} "
                           f"(layer {LAYERS[theirs]})")
    return bad


def adapter_only_violations(mods: Modules) -> list[str]:
    return [f"{mods[name]}:{line}: imports {target}" for name in mods if top(name) not in ADAPTER
            for target, line in imports(mods, name) if target.split(".")[0] in ADAPTER_ONLY]


def experiment(name: str) -> str | None:
    """The experiment (``sgl_kvtier.experiments.<name>``) a module belongs to; None outside one."""
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["sgl_kvtier", "experiments"] else None


def cross_experiment_imports(mods: Modules, allowed: dict[tuple[str, str], str]) -> list[str]:
    bad = []
    for name in mods:
        mine = experiment(name)
        if mine is None:
            continue
        for target, line in imports(mods, name):
            theirs = experiment(target)
            if theirs is not None and theirs != mine and (mine, theirs) not in allowed:
                bad.append(f"{mods[name]}:{line}: experiment {mine} imports {target} (experiment {theirs})")
    return sorted(set(bad))


def cycles(mods: Modules) -> list[str]:
    graph = {}
    for name in mods:
        edges = set()
        for target, _ in imports(mods, name):
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                mod = ".".join(parts[:i])
                if mod in mods and mod != name and not name.startswith(mod + "."):
                    edges.add(mod)
        graph[name] = edges
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []
    found: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return found


MODULES = find_modules(ROOT)


def test_every_package_has_a_layer():
    assert not unlayered(MODULES), f"packages with no layer here (and in docs/design/architecture.md): {unlayered(MODULES)}"


def test_no_upward_or_sideways_imports():
    bad = sorted(set(layer_violations(MODULES)))
    assert not bad, "\n".join(bad)


def test_the_adapter_never_imports_an_experiment():
    bad = [f"{MODULES[name]}:{line}: imports {target}" for name in MODULES if top(name) == "sglang"
           for target, line in imports(MODULES, name) if top(target) == "experiments"]
    assert not bad, "\n".join(bad)


def test_only_the_adapter_and_experiments_import_sglang_or_torch():
    bad = adapter_only_violations(MODULES)
    assert not bad, "\n".join(bad)


def test_no_experiment_imports_another():
    bad = cross_experiment_imports(MODULES, EXPERIMENT_DEPENDENCIES)
    assert not bad, "\n".join(bad)


def test_the_dependencies_between_experiments_are_listed_one_way():
    present = {experiment(name) for name in MODULES} - {None}
    for importer, imported in EXPERIMENT_DEPENDENCIES:
        assert {importer, imported} <= present, f"no such experiment: {importer} -> {imported}"
        assert (imported, importer) not in EXPERIMENT_DEPENDENCIES, f"both ways: {importer} <-> {imported}"


def test_no_import_cycles():
    found = cycles(MODULES)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small_and_documented(name):
    path = MODULES[name]
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"{path.relative_to(ROOT)}: over {MAX_LINES} lines: split it"
    if text.strip():
        assert ast.get_docstring(ast.parse(text)), f"{path.relative_to(ROOT)}: no module docstring"


def test_the_checks_catch_each_kind_of_violation(tmp_path):
    """On a made-up tree: an upward import, torch outside the adapter, a package-init cycle, an unknown package,
    an experiment importing another (lazily) besides a listed dependency."""
    files = {
        "sgl_kvtier/__init__.py": "",
        "sgl_kvtier/store/__init__.py": "from sgl_kvtier.store.page import Page\n",
        "sgl_kvtier/store/page.py": "import torch\nfrom sgl_kvtier.sglang import storage\n",
        "sgl_kvtier/store/format.py": "",
        "sgl_kvtier/sglang/__init__.py": "",
        "sgl_kvtier/sglang/storage.py": "import torch\nfrom sgl_kvtier.store import format\n",
        "sgl_kvtier/io/__init__.py": "",
        "sgl_kvtier/io/a.py": "from . import b\n",
        "sgl_kvtier/io/b.py": "def f():\n    import sgl_kvtier.io.a\n",
        "sgl_kvtier/gadgets/__init__.py": "",
        "sgl_kvtier/experiments/__init__.py": "",
        "sgl_kvtier/experiments/alpha/__init__.py": "",
        "sgl_kvtier/experiments/alpha/hooks.py": "def f():\n    from sgl_kvtier.experiments.beta import plugin\n",
        "sgl_kvtier/experiments/beta/__init__.py": "",
        "sgl_kvtier/experiments/beta/plugin.py": "from sgl_kvtier.experiments.gamma.gate import Gate\n",
        "sgl_kvtier/experiments/gamma/__init__.py": "",
        "sgl_kvtier/experiments/gamma/gate.py": "from sgl_kvtier.experiments import gamma\n",
    }
    for rel, src in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    mods = find_modules(tmp_path)
    assert unlayered(mods) == ["gadgets"]
    assert [v.split(": ", 1)[1] for v in layer_violations(mods)] == \
        ["store (layer 4) imports sgl_kvtier.sglang.storage (layer 8)"]
    assert [v.rsplit(": ", 1)[1] for v in adapter_only_violations(mods)] == ["imports torch"]
    assert {frozenset(c.split(" -> ")) for c in cycles(mods)} == {
        frozenset({"sgl_kvtier.io.a", "sgl_kvtier.io.b"}),
        frozenset({"sgl_kvtier.store", "sgl_kvtier.store.page", "sgl_kvtier.sglang.storage"})}
    assert [v.split(": ", 1)[1] for v in cross_experiment_imports(mods, {("beta", "gamma"): "listed"})] == \
        ["experiment alpha imports sgl_kvtier.experiments.beta.plugin (experiment beta)"]
