"""Prove optional native code works on this machine before any process of ours runs it.

A wheel built for a newer CPU kills its caller with SIGILL (no traceback), and a kernel or container may
refuse the syscalls. So ``check`` first runs the probe's target in a child
(``python -m sgl_kvtier.io.probe --child module:function``, with a timeout), which prints one line
``MARKER + json({"status", "reason"})``; the parent turns that line, the killing signal, the exit status or
the timeout into a ``ProbeVerdict``.

Invariants: ``check`` never raises for a failing probe, and the asking process never imports the probed
code; the child gets the parent's ``sys.path`` and no core file. A verdict is memoised per ``Probe`` and
cached on disk under the sha256 of ``fingerprint`` (target source, Python, packages, kernel, CPU flags,
io_uring sysctl, seccomp, memlock); a TIMEOUT is never cached (a busy machine, not a property of it).

Cache file (``$KVTIER_PROBE_CACHE``, else ``$XDG_CACHE_HOME`` or ``~/.cache``, ``sgl-kvtier/probe.json``)::

    {"format": 1, "entries": {"<key>": {"probe": "uring", "status": "available", "reason": "",
                                         "seconds": <float>, "checked_at": <unix time>, "fingerprint": {...}}}}

Written to a temporary file and renamed; a missing or corrupt file reads as empty; at most ``MAX_ENTRIES``
entries, newest kept. Two processes probing at once both probe; one write wins.
"""

from __future__ import annotations

import argparse
import enum
import errno
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_kvtier import __version__
from sgl_kvtier.errors import KVTierError

log = logging.getLogger(__name__)
MARKER = "SGL_KVTIER_PROBE "  # the child's verdict line starts with this
CACHE_ENV = "KVTIER_PROBE_CACHE"
FORMAT = 1
MAX_ENTRIES = 64


class ProbeStatus(enum.Enum):
    """How a probe ended; every status but AVAILABLE means the probed code must not run here."""

    AVAILABLE = "available"
    NOT_INSTALLED = "not_installed"  # a module the target imports is not installed
    IMPORT_FAILED = "import_failed"  # installed, but it does not load (a missing shared library, an ABI)
    CRASHED = "crashed"  # the child died by a signal (SIGILL: instructions this CPU lacks)
    DENIED = "denied"  # the kernel refused: a seccomp filter, a sysctl (EPERM, EACCES, ENOSYS)
    MEMLOCK = "memlock"  # RLIMIT_MEMLOCK too small for the engine's memory
    UNSUPPORTED = "unsupported"  # the kernel lacks a feature the engine needs
    TIMEOUT = "timeout"  # the child did not answer in time (never written to the cache file)
    FAILED = "failed"  # anything else: the child's error or exit status


@dataclass(frozen=True)
class Probe:
    """An optional native component and how to prove it: ``target`` ("module:function") runs in the child."""

    name: str
    target: str
    packages: tuple[str, ...] = ()  # distributions whose versions key the cache and name a crash's culprit
    timeout_s: float = 30.0


@dataclass(frozen=True)
class ProbeVerdict:
    """The answer for one probe on this machine: its status and, unless available, a specific reason."""

    probe: str
    status: ProbeStatus
    reason: str  # "" when available
    seconds: float  # how long the child ran (when the verdict was made, for a cached one)
    cached: bool = False  # read from the cache file rather than probed by this process

    @property
    def available(self) -> bool:
        """True when the probed code ran correctly in the child."""
        return self.status is ProbeStatus.AVAILABLE


class ProbeFailure(Exception):
    """Raised by a probe target (in the child) to report a specific status and reason."""

    def __init__(self, status: ProbeStatus, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


class ProbeUnavailableError(KVTierError):
    """Code was about to use a component whose probe did not say available."""

    def __init__(self, verdict: ProbeVerdict):
        super().__init__(f"{verdict.probe} is unavailable here: {verdict.reason}")
        self.verdict = verdict


URING = Probe("uring", "sgl_kvtier.io.uring:self_test", packages=("liburing",))
PROBES: dict[str, Probe] = {URING.name: URING}  # by name; tests replace entries to inject a fake engine
Runner = Callable[[Probe], ProbeVerdict]

_memo: dict[Probe, ProbeVerdict] = {}
_lock = threading.Lock()  # one child per process at a time; the memo with it


def check(probe: Probe | str, *, runner: Runner | None = None) -> ProbeVerdict:
    """The verdict for ``probe`` (or the registered probe of that name): memo, else cache file, else a
    child run by ``runner`` (default ``run_child``). Never raises for a failing probe."""
    p = PROBES[probe] if isinstance(probe, str) else probe
    with _lock:
        verdict = _memo.get(p)
        if verdict is not None:
            return verdict
        fp = fingerprint(p)
        key = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:32]
        path = cache_path()
        verdict = _verdict_of_entry(p, _read_cache(path).get(key))
        if verdict is None:
            verdict = (runner or run_child)(p)
            log.info("probe %s: %s%s (%.2f s in a child process)", p.name, verdict.status.value,
                     f": {verdict.reason}" if verdict.reason else "", verdict.seconds)
            if verdict.status is not ProbeStatus.TIMEOUT:
                _write_cache(path, key, fp, verdict)
        _memo[p] = verdict
        return verdict


def require(probe: Probe | str) -> None:
    """Return when ``probe`` is available here; else raise ``ProbeUnavailableError`` with its reason."""
    verdict = check(probe)
    if not verdict.available:
        raise ProbeUnavailableError(verdict)


def clear_memo() -> None:
    """Forget the in-process verdicts (tests: the next ``check`` reads the cache file again)."""
    with _lock:
        _memo.clear()


def cache_path() -> Path:
    """The cache file: ``$KVTIER_PROBE_CACHE``, else under ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sgl-kvtier" / "probe.json"


def fingerprint(p: Probe) -> dict[str, str]:
    """What a verdict depends on (see the module docstring); read without importing the probed code."""
    uname = os.uname()
    return {
        "probe": p.name,
        "target": p.target,
        "target_source": _source_digest(p.target.partition(":")[0]),
        "python": sys.version,
        "executable": sys.executable,
        "packages": ",".join(f"{d}={_dist_version(d)}" for d in p.packages),
        "sgl_kvtier": __version__,
        "kernel": uname.release,
        "machine": uname.machine,
        "cpu_flags": hashlib.sha256(_cpu_flags().encode()).hexdigest()[:16],
        "io_uring_disabled": proc_text("/proc/sys/kernel/io_uring_disabled"),
        "seccomp": proc_text("/proc/self/status", "Seccomp:"),
        "memlock": repr(resource.getrlimit(resource.RLIMIT_MEMLOCK)),
    }


def run_child(p: Probe) -> ProbeVerdict:
    """Run ``p.target`` in a fresh interpreter and read its verdict; the default ``Runner``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
    cmd = [sys.executable, "-m", "sgl_kvtier.io.probe", "--child", p.target]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=p.timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return ProbeVerdict(p.name, ProbeStatus.TIMEOUT, f"the probe did not answer within {p.timeout_s:g} s",
                            time.monotonic() - start)
    except OSError as exc:
        return ProbeVerdict(p.name, ProbeStatus.FAILED, f"cannot start the probe's child process: {exc}",
                            time.monotonic() - start)
    status, reason = _outcome(p, proc.returncode, proc.stdout, proc.stderr)
    return ProbeVerdict(p.name, status, reason, time.monotonic() - start)


def _outcome(p: Probe, returncode: int, stdout: str, stderr: str) -> tuple[ProbeStatus, str]:
    """The status and reason a child's exit, output and verdict line amount to."""
    if returncode < 0:
        return ProbeStatus.CRASHED, signal_reason(p, -returncode)
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARKER):
            try:
                answer = json.loads(line[len(MARKER):])
                return ProbeStatus(answer["status"]), str(answer["reason"])
            except (ValueError, KeyError, TypeError):
                break
    tail = stderr.strip().splitlines()[-1:] or ["no output"]
    return ProbeStatus.FAILED, f"the probe's child exited with status {returncode} without a verdict: {tail[0]}"


def signal_reason(p: Probe, signum: int) -> str:
    """Why a child killed by ``signum`` says the probed code cannot run: the signal named first."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    culprit = " / ".join(f"the {d} {_dist_version(d)} wheel" for d in p.packages) or f"the probe target {p.target}"
    if signum == signal.SIGILL:
        return f"SIGILL: {culprit} uses instructions this CPU lacks (illegal instruction)"
    return f"{name}: {culprit} crashed the probe's child process ({signal.strsignal(signum) or name})"


def classify(exc: BaseException) -> tuple[ProbeStatus, str]:
    """The status and reason of an exception raised by a probe target (in the child)."""
    if isinstance(exc, ProbeFailure):
        return exc.status, exc.reason
    if isinstance(exc, ModuleNotFoundError):
        return ProbeStatus.NOT_INSTALLED, f"the {exc.name or 'required'} package is not installed ({exc})"
    if isinstance(exc, ImportError):
        return ProbeStatus.IMPORT_FAILED, f"{exc.name or 'a module'} is installed but does not load: {exc}"
    if isinstance(exc, OSError) and exc.errno in (errno.EPERM, errno.EACCES, errno.ENOSYS):
        code = errno.errorcode[exc.errno]
        return ProbeStatus.DENIED, f"{code}: the kernel refused (a seccomp filter or a sysctl): {exc}"
    return ProbeStatus.FAILED, f"{type(exc).__name__}: {exc}"


def _child(target: str) -> int:
    """The child's side: run ``target`` and print its verdict line. Exits 0 whatever the verdict."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    status, reason = ProbeStatus.AVAILABLE, ""
    try:
        module, _, function = target.partition(":")
        fn: Callable[[], object] = getattr(importlib.import_module(module), function)
        fn()
    except BaseException as exc:  # noqa: BLE001 - every way the target can fail is a verdict
        status, reason = classify(exc)
    print(MARKER + json.dumps({"status": status.value, "reason": reason}), flush=True)
    return 0


def _verdict_of_entry(p: Probe, entry: object) -> ProbeVerdict | None:
    """A cached verdict, or None for a missing or malformed entry."""
    if not isinstance(entry, Mapping) or entry.get("probe") != p.name:
        return None
    try:
        return ProbeVerdict(p.name, ProbeStatus(entry["status"]), str(entry["reason"]), float(entry["seconds"]),
                            cached=True)
    except (KeyError, ValueError, TypeError):
        return None


def _read_cache(path: Path) -> dict[str, Any]:
    """The file's entries; {} for a missing, unreadable or corrupt file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) and data.get("format") == FORMAT else None
    return entries if isinstance(entries, dict) else {}


def _write_cache(path: Path, key: str, fp: dict[str, str], verdict: ProbeVerdict) -> None:
    """Add one entry (dropping the oldest past ``MAX_ENTRIES``); an unwritable cache is only logged."""
    entries = {k: v for k, v in _read_cache(path).items() if isinstance(v, dict)}
    entries[key] = {"probe": verdict.probe, "status": verdict.status.value, "reason": verdict.reason,
                    "seconds": round(verdict.seconds, 4), "checked_at": time.time(), "fingerprint": fp}
    newest = sorted(entries.items(), key=lambda kv: float(kv[1].get("checked_at") or 0), reverse=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probe-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "entries": dict(newest[:MAX_ENTRIES])}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as exc:
        log.debug("probe cache %s not written: %s", path, exc)


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _source_digest(module: str) -> str:
    """sha256 prefix of the module's source file, found without importing it ("absent" if none)."""
    try:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
        return hashlib.sha256(Path(origin).read_bytes()).hexdigest()[:16] if origin else "absent"
    except (ImportError, OSError, ValueError):
        return "absent"


def _cpu_flags() -> str:
    """The first ``flags`` (x86) or ``Features`` (arm) line of /proc/cpuinfo; "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return ""


def proc_text(path: str, field: str | None = None) -> str:
    """A /proc file's content, or the rest of its first line starting with ``field``; "" where absent."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    if field is None:
        return text.strip()
    return next((line[len(field):].strip() for line in text.splitlines() if line.startswith(field)), "")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sgl_kvtier.io.probe [NAME ...]``: print the verdicts (``--child`` is the child's side)."""
    parser = argparse.ArgumentParser(prog="python -m sgl_kvtier.io.probe", description=main.__doc__)
    parser.add_argument("names", nargs="*", help=f"probes to check (default: all of {', '.join(PROBES)})")
    parser.add_argument("--child", metavar="MODULE:FUNCTION", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child)
    unknown = [name for name in args.names if name not in PROBES]
    if unknown:
        parser.error(f"unknown probe {unknown[0]!r} (known: {', '.join(PROBES)})")
    verdicts = [check(name) for name in (args.names or list(PROBES))]
    for v in verdicts:
        print(json.dumps({"probe": v.probe, "status": v.status.value, "reason": v.reason,
                          "seconds": round(v.seconds, 3), "cached": v.cached}))
    return 0 if all(v.available for v in verdicts) else 1


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy, so that a target raising
    # ``sgl_kvtier.io.probe.ProbeFailure`` is classified by the same class.
    from sgl_kvtier.io.probe import main as _main

    sys.exit(_main())
