"""A fault-injecting IO engine wrapper, seeded, for reliability suites (never for production).

Enabled with the store config key ``fault_injection`` (a table). Faults, per op:
    read_error_rate / write_error_rate   the op fails with EIO
    enospc_rate                          a write fails with ENOSPC
    stall_rate + stall_s                 the op completes, ``stall_s`` seconds late
    torn_write_rate                      only the first half of a write reaches the device, reported done
    down                                 device indices whose every op fails with EIO (the device is gone)
``control_file``, if given, is a JSON file with any of these keys; it is re-read when it changes, so a test
can make a device vanish and come back under a running server. Every decision comes from one RNG
seeded with ``seed``; the seed is logged.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import threading
import time
from typing import Any, Sequence

from sgl_kvtier.io.engine import IOEngine, IOOp, IOResult, OpKind, digest

log = logging.getLogger(__name__)
KNOBS = ("read_error_rate", "write_error_rate", "enospc_rate", "stall_rate", "stall_s", "torn_write_rate", "down")


class FaultyEngine:
    def __init__(self, inner: IOEngine, settings: dict[str, Any]):
        self.inner = inner
        self.name = f"faulty({inner.name})"
        self.seed = int(settings.get("seed", 0))
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._base = {k: settings[k] for k in KNOBS if k in settings}
        self._control = settings.get("control_file")
        self._control_mtime: float | None = None
        self._live: dict[str, Any] = dict(self._base)
        self.injected = {"error": 0, "enospc": 0, "stall": 0, "torn": 0, "down": 0}
        log.warning("fault injection on (seed %d): %s", self.seed, self._base)

    def _knobs(self) -> dict[str, Any]:
        if self._control:
            try:
                mtime = os.stat(self._control).st_mtime_ns
            except FileNotFoundError:
                mtime = None
            if mtime != self._control_mtime:
                self._control_mtime = mtime
                live = dict(self._base)
                if mtime is not None:
                    try:
                        with open(self._control) as f:
                            live.update(json.load(f))
                    except (OSError, ValueError):
                        pass  # a half-written control file: keep the previous knobs
                self._live = live
        return self._live

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        with self._lock:
            knobs = self._knobs()
            plan = [self._decide(op, knobs) for op in ops]
        passed = [op if fault is None or fault in ("stall", "torn") else None for op, fault in zip(ops, plan)]
        torn = [self._torn(op) if fault == "torn" else op for op, fault in zip(ops, plan)]
        real = self.inner.run([t for t, p in zip(torn, passed) if p is not None]) if any(passed) else []
        results, it = [], iter(real)
        stall = max((float(knobs.get("stall_s", 0.0)) for f in plan if f == "stall"), default=0.0)
        if stall:
            time.sleep(stall)  # the fault being simulated is a slow device
        for op, fault, p in zip(ops, plan, passed):
            if p is None:
                code = errno.ENOSPC if fault == "enospc" else errno.EIO
                results.append(IOResult(0, None, OSError(code, f"injected {fault}"), seconds=0.0))
                continue
            res = next(it)
            if fault == "stall":
                res.seconds = max(res.seconds, stall)
            if fault == "torn" and res.ok:
                # The device kept half, but says it took it all, with the checksum of the whole page.
                full = digest(op.buffers) if op.checksum else None
                res = IOResult(sum(b.nbytes for b in op.buffers), full, None, seconds=res.seconds)
            results.append(res)
        return results

    def _decide(self, op: IOOp, knobs: dict[str, Any]) -> str | None:
        if op.device in (knobs.get("down") or ()):
            self.injected["down"] += 1
            return "down"
        r = self._rng.random
        write = op.kind is OpKind.WRITE
        if r() < float(knobs.get("write_error_rate" if write else "read_error_rate", 0.0)):
            self.injected["error"] += 1
            return "error"
        if write and r() < float(knobs.get("enospc_rate", 0.0)):
            self.injected["enospc"] += 1
            return "enospc"
        if write and r() < float(knobs.get("torn_write_rate", 0.0)):
            self.injected["torn"] += 1
            return "torn"
        if r() < float(knobs.get("stall_rate", 0.0)):
            self.injected["stall"] += 1
            return "stall"
        return None

    @staticmethod
    def _torn(op: IOOp) -> IOOp:
        half, out = sum(b.nbytes for b in op.buffers) // 2 // 4096 * 4096, []
        for b in op.buffers:
            if half <= 0:
                break
            out.append(b[:min(half, b.nbytes)])
            half -= b.nbytes
        return IOOp(op.kind, op.fd, op.offset, out or [op.buffers[0][:0]], checksum=False, device=op.device)

    def close(self) -> None:
        self.inner.close()

