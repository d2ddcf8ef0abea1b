"""sgl-kvtier's SGLang general plugins: one ``sglang.srt.plugins`` entry point (``kvtier`` -> ``load``), every
plugin opt-in.

SGLang runs every installed general plugin's entry point early in each of its processes (``load_plugins()``),
whether or not that process uses sgl-kvtier, so installing the package must change nothing there: ``load()``
reads the environment and, with no switch set, returns; this module imports only the standard library and
logs nothing. The switches are environment variables, since ``load()`` runs before any backend config exists
(``sgl-kvtier launch`` and ``serving.server`` set them from the ``[kvtier]`` keys):

=================  ===================================  ========================================  =========
plugin             switch                               module (what it does)                     SGLang
=================  ===================================  ========================================  =========
``cpu_shims``      ``KVTIER_CPU_SHIMS=1``               ``plugins.cpu`` (HiCache on a CPU host)   0.5.22-23
``cost_policy``    ``KVTIER_PREFETCH_POLICY=cost``      ``experiments.cost_policy`` (prefetch     0.5.23
                                                        stop: load or recompute)
``layer_loader``   ``KVTIER_LAYER_LOADER=1``            ``experiments.layer_loader`` (CPU         0.5.23
                                                        load-backs layer by layer)
``stream``         ``KVTIER_STREAM=1`` (set by          ``experiments.streaming`` (streamed L3    0.5.23
                   ``streaming = "on"``)                tails)
=================  ===================================  ========================================  =========

All or nothing (``register_all``): a switched-on plugin registers its hooks only when the running SGLang is a
release it is tested on and every hook target resolves; otherwise it registers none and says why in one
warning. ``status`` / ``why_off`` tell the backend which (it logs why ``streaming = "on"`` cannot stream);
``running`` tells a plugin whether another one runs, without importing it.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

# (dotted target under sglang.srt, hook function, "AROUND" | "AFTER" | "BEFORE")
HookSpec = tuple[str, Callable[..., Any], str]
ON = "on"


@dataclasses.dataclass(frozen=True)
class Plugin:
    """One opt-in plugin: its switch, its module (whose ``load()`` runs when switched on), and the SGLang
    releases it is tested on."""

    name: str
    env: str
    on_value: str
    module: str
    tested_on: tuple[str, ...]

    def wanted(self, environ: Any = None) -> bool:
        """Whether the environment switches this plugin on."""
        return (os.environ if environ is None else environ).get(self.env, "").strip().lower() == self.on_value


PLUGINS = (
    Plugin("cpu_shims", "KVTIER_CPU_SHIMS", "1", "sgl_kvtier.sglang.plugins.cpu", ("0.5.22", "0.5.23")),
    Plugin("cost_policy", "KVTIER_PREFETCH_POLICY", "cost", "sgl_kvtier.experiments.cost_policy.plugin", ("0.5.23",)),
    Plugin("layer_loader", "KVTIER_LAYER_LOADER", "1", "sgl_kvtier.experiments.layer_loader.plugin", ("0.5.23",)),
    Plugin("stream", "KVTIER_STREAM", "1", "sgl_kvtier.experiments.streaming.plugin", ("0.5.23",)),
)
BY_NAME = {p.name: p for p in PLUGINS}
_status: dict[str, str] = {}  # plugin name -> ON, or why it stayed off (only for plugins switched on)


def load() -> None:
    """The ``sglang.srt.plugins`` entry point: each switched-on plugin's ``load()``; nothing else."""
    for plugin in PLUGINS:
        if plugin.wanted():
            importlib.import_module(plugin.module).load()


def status(name: str) -> str | None:
    """``"on"``, why the plugin stayed off although switched on, or None (not switched on in this process)."""
    return _status.get(name)


def running(name: str) -> bool:
    """Whether the plugin ``name`` registered its hooks in this process."""
    return _status.get(name) == ON


def why_off(name: str) -> str:
    """Why the plugin ``name`` does not run in this process, for a log line (``""``: it runs)."""
    state = _status.get(name)
    if state == ON:
        return ""
    if state is not None:
        return state
    plugin = BY_NAME[name]
    return f"{plugin.env}={plugin.on_value} is not set in the server's environment"


def resolves(target: str) -> bool:
    """Whether ``target`` (a module, or ``module.path.Class.attr``) exists in the running SGLang (imports it)."""
    import pkgutil

    try:
        pkgutil.resolve_name(target)
    except (ImportError, AttributeError, ValueError):
        return False
    return True


def check(name: str, targets: Sequence[str], version: str | None = None) -> str | None:
    """Why plugin ``name`` cannot run on the installed (or given) SGLang, or None: the release is one it is
    tested on and every target resolves."""
    from sgl_kvtier.sglang import release

    plugin = BY_NAME[name]
    found = release.installed() if version is None else version
    rel = None if found is None else release.release_or_none(found)
    if rel not in plugin.tested_on:
        return f"tested on SGLang {', '.join(plugin.tested_on)}; this is {found or 'no SGLang'}"
    missing = [t for t in targets if not resolves(t)]
    if missing:
        return f"SGLang {found} lacks {', '.join(missing)}"
    return None


def register_all(name: str, specs: Sequence[HookSpec], targets: Sequence[str] = ()) -> bool:
    """Register every hook of plugin ``name``, or none: see ``check`` (``targets``: more names the plugin
    needs besides its hook targets). Returns whether it did; says why not in one warning."""
    why = check(name, [t for t, _, _ in specs] + list(targets))
    if why is not None:
        _status[name] = why
        logger.warning("sgl_kvtier %s plugin stays off (%s was set): %s", name, BY_NAME[name].env, why)
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, fn, kind in specs:
        HookRegistry.register(target, fn, HookType[kind])
    _status[name] = ON
    return True


__all__ = ["BY_NAME", "ON", "PLUGINS", "HookSpec", "Plugin", "check", "load", "register_all", "resolves", "running",
           "status", "why_off"]
