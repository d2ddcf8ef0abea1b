"""SGLang's hook registry, kept per test: hooks a test registers and the SGLang methods they patch come back
as they were afterwards (``keep_hooks``); ``install_hooks`` applies a plugin's ``HOOKS`` list on top."""

from __future__ import annotations

import importlib
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import pytest


def keep_hooks(monkeypatch: pytest.MonkeyPatch, targets: Iterable[tuple[type, str]]) -> dict[str, Any]:
    """Restore the hook registry and the methods ``targets`` (class, name) after the test; their originals."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list, {k: list(v) for k, v in HookRegistry._hooks.items()}))
    monkeypatch.setattr(HookRegistry, "_patched", set(HookRegistry._patched))
    originals = {}
    for cls, name in targets:
        monkeypatch.setattr(cls, name, cls.__dict__[name])
        originals[name] = cls.__dict__[name]
    return originals


def install_hooks(monkeypatch: pytest.MonkeyPatch, specs: Iterable[tuple[str, Any, str]]) -> None:
    """Register and apply ``(dotted target, function, "AROUND" | "AFTER" | "BEFORE")`` hooks for one test."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    specs = list(specs)
    targets = []
    for target, _, _ in specs:
        module, cls_name, name = target.rsplit(".", 2)
        targets.append((getattr(importlib.import_module(module), cls_name), name))
    keep_hooks(monkeypatch, targets)
    for target, fn, kind in specs:
        HookRegistry.register(target, fn, HookType[kind])
    HookRegistry.apply_hooks()
