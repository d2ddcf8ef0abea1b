"""The one entry point and its opt-in plugins (``sgl_kvtier.sglang.plugins``), on the SGLang installed here.

- Installed is not switched on: SGLang's own ``load_plugins()`` in a fresh process with no ``KVTIER_*``
  switch imports nothing of ours beyond the entry point, registers no hook and logs nothing of ours.
- All or nothing: a plugin switched on registers every hook it has, or, on a release it is not tested on or
  with one target missing, none, in one warning naming why; ``why_off`` tells the backend the same.
This file runs on every supported release (the range run, ``test_sglang_range``): what a plugin does there
follows from its ``tested_on``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest.importorskip("sglang")

from hook_kit import keep_hooks  # noqa: E402

from sgl_kvtier.serving import server  # noqa: E402
from sgl_kvtier.sglang import plugins, release  # noqa: E402
from sgl_kvtier.sglang.plugins import BY_NAME, PLUGINS  # noqa: E402

PLAIN_PROCESS = r"""
import json, logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.name + ": " + record.getMessage())
logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.DEBUG)
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
print(json.dumps({
    "modules": sorted(m for m in sys.modules if m == "sgl_kvtier" or m.startswith("sgl_kvtier.")),
    "hooks": sorted(t for t, hooks in HookRegistry._hooks.items()
                    if any(src is not None and src.plugin_name == "kvtier" for _, _, src in hooks)),
    "ours": [r for r in records if r.startswith("sgl_kvtier")],
    "named": [r for r in records if "kvtier" in r],
}))
"""


def without_switches() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_") and k != "SGLANG_PLUGINS"}


def test_one_entry_point_and_it_is_the_switchboard() -> None:
    ours = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.value.startswith("sgl_kvtier")]
    assert [(ep.name, ep.value) for ep in ours] == [("kvtier", "sgl_kvtier.sglang.plugins:load")]
    assert ours[0].load() is plugins.load


def test_an_sglang_process_that_asks_for_nothing_is_unchanged() -> None:
    out = subprocess.run([sys.executable, "-c", PLAIN_PROCESS], env=without_switches(), capture_output=True,
                         text=True, timeout=300, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["modules"] == ["sgl_kvtier", "sgl_kvtier.sglang", "sgl_kvtier.sglang.plugins"]
    assert seen["hooks"] == [] and seen["ours"] == []
    # What remains is SGLang's own loader naming the entry point it found and ran (it lists every plugin).
    assert all(r.startswith("sglang.srt.plugins: ") for r in seen["named"]), seen["named"]


@pytest.mark.parametrize("value", ["", "0", "off", "yes"])
def test_a_switch_not_set_to_its_value_is_off(monkeypatch, value) -> None:
    for plugin in PLUGINS:
        monkeypatch.setenv(plugin.env, value)
        assert not plugin.wanted()
    monkeypatch.setenv(BY_NAME["stream"].env, "1")
    monkeypatch.setenv(BY_NAME["cost_policy"].env, " Cost ")
    assert BY_NAME["stream"].wanted() and BY_NAME["cost_policy"].wanted()


@pytest.fixture
def registry(monkeypatch):
    """SGLang's hook registry as it was, after the test (nothing here applies hooks: no method changes)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    keep_hooks(monkeypatch, [])
    monkeypatch.setattr(plugins, "_status", {})
    return HookRegistry


def registered(registry) -> dict[str, int]:
    return {t: len(h) for t, h in registry._hooks.items() if h}


def test_one_missing_target_registers_none(registry, monkeypatch, caplog) -> None:
    from sgl_kvtier.experiments.streaming import plugin as stream

    specs = [*stream.hook_specs(), ("sglang.srt.managers.scheduler.Scheduler.no_such_method", print, "AFTER")]
    monkeypatch.setattr(release, "installed", lambda: "0.5.23")
    before = registered(registry)
    with caplog.at_level(logging.WARNING, logger=plugins.__name__):
        assert not plugins.register_all("stream", specs)
    assert registered(registry) == before
    [line] = [r.getMessage() for r in caplog.records if r.name == plugins.__name__]
    missing = [t for t, _, _ in specs if not plugins.resolves(t)]  # on SGLang 0.5.22 one of the real ones too
    assert missing[-1] == "sglang.srt.managers.scheduler.Scheduler.no_such_method"
    assert line == f"sgl_kvtier stream plugin stays off (KVTIER_STREAM was set): SGLang 0.5.23 lacks {', '.join(missing)}"
    assert plugins.status("stream") == plugins.why_off("stream") == line.split(": ", 1)[1]


def test_an_untested_release_registers_none(registry, monkeypatch, caplog) -> None:
    from sgl_kvtier.experiments.streaming import plugin as stream

    monkeypatch.setattr(release, "installed", lambda: "0.5.22")
    before = registered(registry)
    with caplog.at_level(logging.WARNING, logger=plugins.__name__):
        assert not plugins.register_all("stream", stream.hook_specs())
    assert registered(registry) == before
    assert plugins.why_off("stream") == "tested on SGLang 0.5.23; this is 0.5.22"
    assert len(caplog.records) == 1


def test_each_plugin_on_the_installed_release_is_all_or_nothing(registry, cpu_shims, monkeypatch, caplog) -> None:
    """Every plugin switched on through the entry point: on a release it is tested on, all of its hooks
    (and ``status`` says on); elsewhere none, with its one warning. (``cpu_shims``: the CPU plugin's
    stand-ins are in place already, so its ``load()`` adds only its hooks here.)"""
    import torch

    from sgl_kvtier.experiments.cost_policy import plugin as prefetch
    from sgl_kvtier.experiments.layer_loader import plugin as layer_loader
    from sgl_kvtier.experiments.streaming import plugin as stream
    from sgl_kvtier.sglang.plugins import cpu, cpu_shims
    for module in (cpu, layer_loader, prefetch, stream):
        monkeypatch.setattr(module, "_loaded", False)
    for plugin in PLUGINS:
        monkeypatch.setenv(plugin.env, plugin.on_value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hooks = {"cpu_shims": [cpu_shims.HOST_KV_CACHE_INIT, cpu_shims.EXTEND_ATTENTION],
             "cost_policy": [prefetch.TERMINATE_TARGET, prefetch.BATCH_RESULT_TARGET],
             "layer_loader": [layer_loader.SUBMIT_TARGET, layer_loader.WAIT_TARGET, layer_loader.PRODUCER_TARGET,
                              layer_loader.RUN_BATCH_TARGET, layer_loader.EVENT_DONE_TARGET],
             "stream": [t for t, _, _ in stream.hook_specs()]}
    before = registered(registry)
    with caplog.at_level(logging.WARNING, logger=plugins.__name__):
        plugins.load()
    rel = release.release_of(release.installed() or "")
    expected: dict[str, int] = {}
    for plugin in PLUGINS:
        on = rel in plugin.tested_on
        assert (plugins.status(plugin.name) == plugins.ON) is on, (plugin.name, plugins.status(plugin.name))
        if on:
            for target in hooks[plugin.name]:
                expected[target] = expected.get(target, 0) + 1
        else:
            assert plugins.why_off(plugin.name) == f"tested on SGLang {', '.join(plugin.tested_on)}; this is {rel}"
    added = {t: n - before.get(t, 0) for t, n in registered(registry).items() if n != before.get(t, 0)}
    assert added == expected
    warned = [r.getMessage() for r in caplog.records if r.name == plugins.__name__]
    assert len(warned) == sum(rel not in p.tested_on for p in PLUGINS)


def test_the_launchers_switch_the_stream_plugin_for_streaming_on() -> None:
    assert server.STREAM_ENV == BY_NAME["stream"].env
    assert server.plugin_env({"streaming": "on"}) == {"KVTIER_STREAM": "1"}
    assert server.plugin_env({"streaming": "off"}) == server.plugin_env({}) == {}
    args = ["--page-size", "16", server.EXTRA_CONFIG_FLAG, json.dumps({"devices": ["/x"], "streaming": "on"})]
    assert server.extra_config_of(args)["streaming"] == "on" and server.extra_config_of(["--x"]) == {}


@pytest.mark.parametrize("status, why", [
    (None, "KVTIER_STREAM=1 is not set in the server's environment"),
    ("tested on SGLang 0.5.23; this is 0.5.22", "tested on SGLang 0.5.23; this is 0.5.22"),
    (plugins.ON, None)])
def test_streaming_on_says_once_why_the_stream_plugin_is_off(tmp_path, monkeypatch, caplog, status, why) -> None:
    from pools import mha_host_pool, storage_config

    from sgl_kvtier.sglang import KVTierStorage

    monkeypatch.setattr(plugins, "_status", {} if status is None else {"stream": status})
    backend = KVTierStorage(storage_config({"devices": [str(tmp_path)], "capacity_bytes": 64 << 20,
                                            "streaming": "on"}))
    with caplog.at_level(logging.WARNING, logger="sgl_kvtier.sglang.storage"):
        backend.register_mem_pool_host(mha_host_pool("layer_first"))
        backend.on_host_pools_registered()
    backend.close()
    said = [r.getMessage() for r in caplog.records if "streaming" in r.getMessage()]
    assert said == ([] if why is None else [f'kvtier: streaming = "on" but L3 hits will load whole, as with "off": {why}'])
