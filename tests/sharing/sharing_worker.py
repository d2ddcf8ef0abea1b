"""A pool process driven over pipes by tests/sharing/test_sharing.py: one JSON command a line on stdin, one
JSON reply a line on stdout (``churn`` and ``read_loop`` reply with several lines, the last ``done``).

Pages are ``page(n)``: bytes derived from the key number alone, so any process checks any page it reads
byte for byte without being sent it. Run as ``python sharing_worker.py`` with the repository root and
``tests/`` on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
from support import HostMemory, key, namespace, store_config

from sgl_kvtier.sharing.pool import SharedPool

BATCH = 8


def page(n: int, page_bytes: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, page_bytes, dtype=np.uint8).tobytes()


class Worker:
    def __init__(self) -> None:
        self.pool: SharedPool | None = None
        self.page_bytes = 0
        self.mem: HostMemory | None = None

    def open(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.page_bytes = cmd["page_bytes"]
        config = store_config(cmd["path"], cmd.get("capacity_pages", 64), self.page_bytes, **cmd.get("config", {}))
        ns = namespace(self.page_bytes)
        opener = SharedPool.open_writer if cmd["role"] == "writer" else SharedPool.open_reader
        self.pool = opener(config, ns)
        self.mem = HostMemory(BATCH, self.page_bytes)
        return {"wid": self.pool.wid, "pid": os.getpid(), "store_id": self.pool.layout.store_id}

    def put(self, numbers: list[int]) -> list[bool]:
        assert self.pool is not None and self.mem is not None
        out: list[bool] = []
        for start in range(0, len(numbers), BATCH):
            chunk = numbers[start:start + BATCH]
            for j, n in enumerate(chunk):
                self.mem.page(j)[:] = np.frombuffer(page(n, self.page_bytes), dtype=np.uint8)
            parent = key(numbers[start - 1]) if start else None
            out += self.pool.put([key(n) for n in chunk], [self.mem.runs(j) for j in range(len(chunk))], parent)
        return out

    def get(self, numbers: list[int]) -> dict[str, list[int]]:
        assert self.pool is not None and self.mem is not None
        seen: dict[str, list[int]] = {"hits": [], "misses": [], "wrong": []}
        for start in range(0, len(numbers), BATCH):
            chunk = numbers[start:start + BATCH]
            self.mem.clear()
            oks = self.pool.get([key(n) for n in chunk], [self.mem.runs(j) for j in range(len(chunk))])
            for j, (n, ok) in enumerate(zip(chunk, oks)):
                if not ok:
                    seen["misses"].append(n)
                elif self.mem.page(j).tobytes() == page(n, self.page_bytes):
                    seen["hits"].append(n)
                else:
                    seen["wrong"].append(n)
        return seen

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any] | None:
        op = cmd["op"]
        if op == "quit":
            return {}
        if op == "open":
            return self.open(cmd)
        assert self.pool is not None
        if op == "put":
            return {"ok": self.put(cmd["keys"])}
        if op == "get":
            return self.get(cmd["keys"])
        if op == "prefix":
            return {"n": self.pool.longest_prefix([key(n) for n in cmd["keys"]])}
        if op == "beat":
            assert self.pool.own is not None and self.pool.own.lease is not None
            self.pool.own.lease.beat()
            return {}
        if op == "refresh":
            return {"changed": self.pool.refresh(force=True)}
        if op == "stats":
            own = self.pool.own
            return {"counters": self.pool.counters.snapshot(), "len": len(self.pool), "wid": self.pool.wid,
                    "sharing": self.pool.sharing_stats(),
                    "own": None if own is None else len(own), "peers": sorted(self.pool.peers()),
                    "own_keys": [] if own is None else sorted(int.from_bytes(k[:4], "little") for k in own.keys())}
        if op == "verdicts":  # each followed writer's liveness verdict on this process's clock
            return {wid: self.pool.verdict(wid).verdict.value for wid in self.pool.peers()}
        if op == "churn":  # put ``keys`` in batches, acknowledging each batch's stored keys at once
            keys = cmd["keys"]
            for start in range(0, len(keys), BATCH):
                chunk = keys[start:start + BATCH]
                ok = self.put(chunk)
                reply({"ack": [n for n, good in zip(chunk, ok) if good]})
            return {"done": True}
        if op == "read_loop":  # read ``keys`` ``rounds`` times, reporting each round
            total: dict[str, int] = {"hits": 0, "misses": 0, "wrong": 0}
            for r in range(cmd["rounds"]):
                seen = self.get(cmd["keys"])
                for k in total:
                    total[k] += len(seen[k])
                reply({"round": r, "wrong": seen["wrong"]})
            return {"done": True, **total, "counters": self.pool.counters.snapshot()}
        if op == "close":
            self.pool.close()
            self.pool = None
            return {}
        raise ValueError(f"unknown op {op!r}")


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    worker = Worker()
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            out = worker.handle(cmd)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
            out = {"error": type(exc).__name__, "message": str(exc)}
        reply(out or {})
        if cmd["op"] == "quit":
            break


if __name__ == "__main__":
    main()
