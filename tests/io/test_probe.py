"""probe: a child process proves optional native code before the asking process runs any of it.

Regression tests for a liburing wheel with AVX-512 instructions that killed the test process with SIGILL
at collection on a CPU without AVX-512: fake engines whose probe dies by a signal are reported unavailable with the
signal named, the asking process goes on, and the verdict is cached (no second child).
"""

from __future__ import annotations

import importlib.metadata
import json
import signal
import subprocess
import sys

import pytest

from sgl_kvtier.io import probe as probes
from sgl_kvtier.io.probe import Probe, ProbeStatus


def entries(path) -> dict:
    data = json.loads(path.read_text())
    assert data["format"] == probes.FORMAT
    return data["entries"]


@pytest.mark.parametrize("target, signame, packages, culprit", [
    ("die_sigill", "SIGILL", ("liburing",), "the liburing {} wheel uses instructions this CPU lacks"),
    ("die_sigsegv", "SIGSEGV", (), "the probe target probe_targets:die_sigsegv crashed"),
])  # fmt: skip
def test_a_probe_killed_by_a_signal_is_unavailable_names_the_signal_and_is_cached(
        probe_cache, runner, target, signame, packages, culprit):
    fake = Probe(f"fake-{target}", f"probe_targets:{target}", packages=packages)
    verdict = probes.check(fake, runner=runner)
    # We are still here: the signal killed the child only.
    assert verdict.status is ProbeStatus.CRASHED and not verdict.available and not verdict.cached
    assert verdict.reason.startswith(f"{signame}: ")
    version = importlib.metadata.version("liburing") if packages else ""
    assert culprit.format(version) in verdict.reason
    assert runner.spawns == 1

    assert probes.check(fake, runner=runner) == verdict  # the in-process memo
    assert runner.spawns == 1

    probes.clear_memo()  # a new process on the same machine: the cache file answers
    again = probes.check(fake, runner=runner)
    assert runner.spawns == 1
    assert again.cached and (again.status, again.reason) == (verdict.status, verdict.reason)
    (entry,) = entries(probe_cache).values()
    assert (entry["probe"], entry["status"], entry["reason"]) == (fake.name, "crashed", verdict.reason)
    assert entry["fingerprint"]["target"] == fake.target


def test_the_signal_names_come_from_the_signal_module():
    p = Probe("x", "m:f", packages=("no-such-dist-here",))
    assert probes.signal_reason(p, signal.SIGILL) == (
        "SIGILL: the no-such-dist-here absent wheel uses instructions this CPU lacks (illegal instruction)")
    assert probes.signal_reason(p, signal.SIGBUS).startswith("SIGBUS: the no-such-dist-here absent wheel crashed")


def test_the_real_uring_probe_answers_a_verdict_here(probe_cache, runner):
    verdict = probes.check("uring", runner=runner)
    assert runner.spawns == 1 and verdict.probe == "uring" and 0 < verdict.seconds < probes.URING.timeout_s
    assert verdict.status is not ProbeStatus.TIMEOUT
    assert (verdict.reason == "") == verdict.available
    fp = probes.fingerprint(probes.URING)
    suitable = ("avx512f" in probes.proc_text("/proc/cpuinfo", "flags") and fp["io_uring_disabled"] in ("0", "")
                and fp["seccomp"] in ("0", "") and fp["packages"] != "liburing=absent")
    if suitable:  # a machine with AVX-512, io_uring on, no seccomp filter and liburing installed
        assert verdict.available, verdict.reason
    assert entries(probe_cache)  # written either way: a property of this machine


def test_a_missing_package_is_reported_as_not_installed(probe_cache, runner):
    verdict = probes.check(Probe("fake-missing", "probe_targets:missing_package"), runner=runner)
    assert verdict.status is ProbeStatus.NOT_INSTALLED
    assert "sgl_kvtier_no_such_native_binding" in verdict.reason and "not installed" in verdict.reason
    module_gone = probes.check(Probe("fake-gone", "no_such_probe_module:f"), runner=runner)
    assert module_gone.status is ProbeStatus.NOT_INSTALLED and "no_such_probe_module" in module_gone.reason


def test_refusals_and_exits_without_a_verdict_are_specific(probe_cache, runner):
    refused = probes.check(Probe("fake-refused", "probe_targets:refused"), runner=runner)
    assert refused.status is ProbeStatus.DENIED and refused.reason.startswith("EPERM: ")
    quiet = probes.check(Probe("fake-exit", "probe_targets:exits_without_verdict"), runner=runner)
    assert quiet.status is ProbeStatus.FAILED and "exited with status 3" in quiet.reason


def test_a_timeout_is_reported_but_not_written_to_the_cache(probe_cache, runner):
    hang = Probe("fake-hang", "probe_targets:hangs", timeout_s=0.5)
    verdict = probes.check(hang, runner=runner)
    assert verdict.status is ProbeStatus.TIMEOUT and "0.5 s" in verdict.reason and verdict.seconds >= 0.5
    assert not probe_cache.exists()
    probes.clear_memo()
    assert probes.check(hang, runner=runner).status is ProbeStatus.TIMEOUT
    assert runner.spawns == 2  # a busy machine is not a property of the machine: asked again


@pytest.mark.parametrize("garbage", [b"{not json", b"[]", b'{"format": 1, "entries": []}', b"\xff\xfe"])
def test_a_corrupt_cache_file_is_ignored_and_rewritten(probe_cache, runner, garbage):
    probe_cache.parent.mkdir(parents=True)
    probe_cache.write_bytes(garbage)
    ok = Probe("fake-ok", "probe_targets:ok")
    assert probes.check(ok, runner=runner).available and runner.spawns == 1
    (entry,) = entries(probe_cache).values()
    assert entry["status"] == "available" and entry["reason"] == ""
    probes.clear_memo()
    assert probes.check(ok, runner=runner).cached and runner.spawns == 1


def test_another_cpu_is_another_cache_entry(probe_cache, runner, monkeypatch):
    ok = Probe("fake-ok", "probe_targets:ok")
    probes.check(ok, runner=runner)
    probes.clear_memo()
    monkeypatch.setattr(probes, "_cpu_flags", lambda: "flags : fpu sse2 avx2")  # the same home, another host
    assert not probes.check(ok, runner=runner).cached and runner.spawns == 2
    assert len(entries(probe_cache)) == 2


def test_an_unwritable_cache_still_answers_from_memory(tmp_path, monkeypatch, runner):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(probes.CACHE_ENV, str(blocker / "probe.json"))  # its parent is a file
    probes.clear_memo()
    ok = Probe("fake-ok", "probe_targets:ok")
    assert probes.check(ok, runner=runner).available and probes.check(ok, runner=runner).available
    assert runner.spawns == 1
    probes.clear_memo()


def test_require_raises_with_the_verdict(probe_cache, monkeypatch):
    monkeypatch.setitem(probes.PROBES, "fake", Probe("fake", "probe_targets:die_sigill"))
    with pytest.raises(probes.ProbeUnavailableError) as err:
        probes.require("fake")
    assert err.value.verdict.status is ProbeStatus.CRASHED and "SIGILL" in str(err.value)
    monkeypatch.setitem(probes.PROBES, "fine", Probe("fine", "probe_targets:ok"))
    probes.require("fine")


def test_cache_path_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv(probes.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert probes.cache_path() == tmp_path / "sgl-kvtier" / "probe.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert probes.cache_path() == tmp_path / "home" / ".cache" / "sgl-kvtier" / "probe.json"


def test_command_line(probe_cache):
    out = subprocess.run([sys.executable, "-m", "sgl_kvtier.io.probe", "no-such-probe"], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 2 and "unknown probe 'no-such-probe'" in out.stderr
    out = subprocess.run([sys.executable, "-m", "sgl_kvtier.io.probe", "uring"], capture_output=True, text=True,
                         check=False)
    (line,) = out.stdout.splitlines()
    answer = json.loads(line)
    assert answer["probe"] == "uring" and out.returncode == (0 if answer["status"] == "available" else 1)
    assert entries(probe_cache)  # the child saw the same KVTIER_PROBE_CACHE
