"""FaultyEngine: seeded faults from a FaultSpec, live control-file knobs, bad control files kept out.

The store-level fault suites (breaker, misses, torn pages) are in tests/store/test_faults.py; here the
wrapper alone, over an inner engine that moves no bytes.
"""

from __future__ import annotations

import errno
import json
import logging
import os

from sgl_kvtier.config import FaultSpec
from sgl_kvtier.io.faulty import Fault, FaultyEngine
from sgl_kvtier.io.ops import IOOp, IOResult, OpKind, op_length


class NullEngine:
    """Answers every op as done; remembers how many ops reached it."""

    name = "null"

    def __init__(self) -> None:
        self.ops = 0

    def run(self, ops):
        self.ops += len(ops)
        return [IOResult(op_length(op), None) for op in ops]

    def close(self) -> None:
        pass


def ops(n: int, kind: OpKind = OpKind.READ, device: int = 0, group: int | None = None) -> list[IOOp]:
    return [IOOp(kind, -1, 0, [memoryview(bytearray(8192))], checksum=False, device=device, group=group)
            for _ in range(n)]


def test_the_same_seed_gives_the_same_faults():
    spec = FaultSpec(seed=5, read_error_rate=0.3)
    runs = [[r.ok for r in FaultyEngine(NullEngine(), spec).run(ops(200))] for _ in range(2)]
    assert runs[0] == runs[1] and 20 < runs[0].count(False) < 100


def test_each_fault_kind():
    inner = NullEngine()
    eng = FaultyEngine(inner, FaultSpec(down=(1,), enospc_rate=1.0))
    gone = eng.run(ops(2, device=1))
    assert [r.error.errno for r in gone] == [errno.EIO, errno.EIO] and eng.injected[Fault.DOWN.value] == 2
    full = eng.run(ops(3, OpKind.WRITE))
    assert [r.error.errno for r in full] == [errno.ENOSPC] * 3 and inner.ops == 0  # nothing reached the device
    torn = FaultyEngine(inner, FaultSpec(torn_write_rate=1.0)).run(ops(1, OpKind.WRITE))
    assert torn[0].ok and torn[0].nbytes == 8192 and inner.ops == 1  # reported whole; half was sent


def test_from_group_aims_the_faults_at_later_read_groups_only():
    inner = NullEngine()
    eng = FaultyEngine(inner, FaultSpec(read_error_rate=1.0, write_error_rate=1.0, down=(0,), from_group=1))
    assert all(r.ok for r in eng.run(ops(3, group=0)))  # group 0 of a group-major read: untouched
    assert all(r.ok for r in eng.run(ops(2)) + eng.run(ops(2, OpKind.WRITE)))  # whole reads, writes: untouched
    assert not any(r.ok for r in eng.run(ops(3, group=1)) + eng.run(ops(2, group=4)))
    assert inner.ops == 7 and eng.injected[Fault.DOWN.value] == 5
    assert not any(r.ok for r in FaultyEngine(inner, FaultSpec(read_error_rate=1.0)).run(ops(2, group=0)))  # 0: all


def test_control_file_knobs_apply_live_and_a_bad_file_keeps_the_previous_ones(tmp_path, caplog):
    control = tmp_path / "faults.json"
    version = iter(range(1, 100))

    def write(text: str) -> None:  # each version gets its own mtime (writes in one clock tick share one)
        control.write_text(text)
        stamp = next(version) * 1_000_000_000
        os.utime(control, ns=(stamp, stamp))

    eng = FaultyEngine(NullEngine(), FaultSpec(control_file=str(control)))
    assert all(r.ok for r in eng.run(ops(4)))
    write(json.dumps({"read_error_rate": 1.0}))
    assert not any(r.ok for r in eng.run(ops(4)))
    with caplog.at_level(logging.WARNING, logger="sgl_kvtier.io.faulty"):
        write(json.dumps({"read_error_rate": 7}))  # not a probability: ignored, logged
        assert not any(r.ok for r in eng.run(ops(4)))
    assert "fault_injection.read_error_rate" in caplog.text
    write("{half")  # a half-written file: the previous knobs stay too
    assert not any(r.ok for r in eng.run(ops(4)))
    control.unlink()  # gone: back to the config's knobs
    assert all(r.ok for r in eng.run(ops(4)))
