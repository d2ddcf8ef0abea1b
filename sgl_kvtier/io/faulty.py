"""A seeded fault-injecting IO engine wrapper for reliability suites (never for production).

Enabled by the store config table ``fault_injection`` (parsed into ``config.FaultSpec``; errors name
``fault_injection.<key>``). Faults, per op:
    read_error_rate / write_error_rate   the op fails with EIO
    enospc_rate                          a write fails with ENOSPC
    stall_rate + stall_s                 the op completes, ``stall_s`` seconds late
    torn_write_rate                      only the first half of a write reaches the device, reported done
                                         (with the digests of the whole write: ``prepare_write`` runs first)
    down                                 device indices whose every op fails with EIO (the device is gone)
    from_group                           > 0: the knobs above strike only reads of a group-major read's
                                         group >= this (``IOOp.group``); every other op runs untouched
                                         (0: every op)
``control_file``, if given, is a JSON file with any of these keys, re-read when it changes (a test can make
a device vanish and come back under a running server); a half-written or invalid one leaves the previous
knobs in force. Every decision comes from one RNG seeded with ``seed`` (logged).
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import json
import logging
import os
import random
import threading
import time
from collections.abc import Sequence

from sgl_kvtier.config import FaultSpec
from sgl_kvtier.errors import ConfigError
from sgl_kvtier.io.ops import IOEngine, IOOp, IOResult, OpKind, digest, prepare_write

log = logging.getLogger(__name__)


class Fault(enum.Enum):
    """What is done to one op; the value is its key in ``FaultyEngine.injected``."""

    DOWN = "down"  # the device is gone: EIO
    ERROR = "error"  # EIO
    ENOSPC = "enospc"  # a write finds the device full
    TORN = "torn"  # half a write reaches the device, reported whole
    STALL = "stall"  # completes, ``stall_s`` late


class FaultyEngine:
    """Wraps an ``IOEngine``; fails, stalls or tears ops as ``settings`` (and its control file) say."""

    def __init__(self, inner: IOEngine, settings: FaultSpec):
        self.inner = inner
        self.name = f"faulty({inner.name})"
        self.seed = settings.seed
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._base = settings
        self._control = settings.control_file
        self._control_mtime: int | None = None
        self._live = settings
        self.injected = {fault.value: 0 for fault in Fault}
        knobs = {k: v for k, v in dataclasses.asdict(settings).items() if k not in ("seed", "control_file") and v}
        log.warning("fault injection on (seed %d): %s", self.seed, knobs)

    def _knobs(self) -> FaultSpec:
        """The knobs in force: the config's, with the control file's applied when it exists."""
        if self._control:
            try:
                mtime: int | None = os.stat(self._control).st_mtime_ns
            except FileNotFoundError:
                mtime = None
            if mtime != self._control_mtime:
                self._control_mtime = mtime
                live = self._base
                if mtime is not None:
                    try:
                        with open(self._control) as f:
                            live = self._base.with_knobs(json.load(f))
                    except ConfigError as exc:
                        log.warning("fault control file %s ignored: %s", self._control, exc)
                        live = self._live
                    except (OSError, ValueError):  # a half-written control file
                        live = self._live
                self._live = live
        return self._live

    def run(self, ops: Sequence[IOOp]) -> list[IOResult]:
        """Run the ops that are not failed outright on the wrapped engine; faults applied, results in order."""
        with self._lock:
            knobs = self._knobs()
            plan = [self._decide(op, knobs) for op in ops]
        passed = [fault in (None, Fault.STALL, Fault.TORN) for fault in plan]
        # A torn write was handed to the device whole: its digests taken, its ``before_write`` called.
        sealed = [prepare_write(op) if fault is Fault.TORN else None for op, fault in zip(ops, plan)]
        sent = [self._torn(op) if fault is Fault.TORN else op for op, fault in zip(ops, plan)]
        real = self.inner.run([op for op, p in zip(sent, passed) if p]) if any(passed) else []
        results: list[IOResult] = []
        it = iter(real)
        stall = knobs.stall_s if Fault.STALL in plan else 0.0
        if stall:
            time.sleep(stall)  # the fault being simulated is a slow device
        for op, fault, p, parts in zip(ops, plan, passed, sealed):
            if not p:
                code = errno.ENOSPC if fault is Fault.ENOSPC else errno.EIO
                results.append(IOResult(0, None, OSError(code, f"injected {fault.value if fault else 'fault'}")))
                continue
            res = next(it)
            if fault is Fault.STALL:
                res.seconds = max(res.seconds, stall)
            if fault is Fault.TORN and res.ok:
                # The device kept half, but says it took it all, with the checksum of the whole page.
                full = digest(op.buffers) if op.checksum else None
                res = IOResult(sum(b.nbytes for b in op.buffers), full, None, seconds=res.seconds, part_digests=parts)
            results.append(res)
        return results

    def _decide(self, op: IOOp, knobs: FaultSpec) -> Fault | None:
        """The fault this op gets (one RNG draw per rate that applies), counted in ``injected``."""
        fault = self._draw(op, knobs)
        if fault is not None:
            self.injected[fault.value] += 1
        return fault

    def _draw(self, op: IOOp, knobs: FaultSpec) -> Fault | None:
        if knobs.from_group and (op.group is None or op.group < knobs.from_group):
            return None  # not a read of the groups the faults are aimed at
        if op.device in knobs.down:
            return Fault.DOWN
        r = self._rng.random
        write = op.kind is OpKind.WRITE
        if r() < (knobs.write_error_rate if write else knobs.read_error_rate):
            return Fault.ERROR
        if write and r() < knobs.enospc_rate:
            return Fault.ENOSPC
        if write and r() < knobs.torn_write_rate:
            return Fault.TORN
        if r() < knobs.stall_rate:
            return Fault.STALL
        return None

    @staticmethod
    def _torn(op: IOOp) -> IOOp:
        """The op cut to its first half (whole 4 KiB blocks), unchecksummed: what reaches the device."""
        half, out = sum(b.nbytes for b in op.buffers) // 2 // 4096 * 4096, []
        for b in op.buffers:
            if half <= 0:
                break
            out.append(b[:min(half, b.nbytes)])
            half -= b.nbytes
        return IOOp(op.kind, op.fd, op.offset, out or [op.buffers[0][:0]], checksum=False, device=op.device)

    def close(self) -> None:
        """Close the wrapped engine."""
        self.inner.close()

