"""What both power-loss layouts (``benchmarks.powerloss``: directories; ``powerloss_raw``: a shared raw pool)
check after a cut: page numbers of keys, the pages writers hold, and the read-back of a reopened state."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.store.crash import page_bytes_for
from benchmarks.store.hostpool import HostPool
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.store.page_store import PageStore


def number(k: bytes) -> int:
    """The page number a workload key carries in its first 4 bytes."""
    return int.from_bytes(k[:4], "little")


def held(pools: list[SharedPool]) -> list[int]:
    """The pages every writer's own index holds now."""
    return sorted(number(k) for p in pools if p.own is not None for k in p.own.keys())


def read_back(result: Any, openers: Sequence[Callable[[], PageStore]], must: set[int], dest: Path,
              page: int) -> Any:
    """Open every writer of the cut's state (``openers``, in order), read every page each indexes into
    ``result`` (pages checked, wrong bytes, acknowledged pages lost, or the refused open), close them all and
    remove ``dest``; returns ``result``."""
    stores: list[PageStore] = []
    mem = HostPool(page, 1)
    try:
        for opener in openers:
            stores.append(opener())
        present: set[int] = set()
        for store in stores:
            for k in store.keys():
                if store.get([k], [mem.runs(0)]) == [True]:
                    result.pages_checked += 1
                    result.wrong_bytes += mem.read(0) != page_bytes_for(number(k), page)
                    present.add(number(k))
        result.acked_lost = len(must - present)
    except Exception as exc:  # noqa: BLE001 - a refused or crashed open after a legal cut is a finding
        result.refused = f"{type(exc).__name__}: {exc}"
    finally:
        for store in stores:
            with contextlib.suppress(Exception):
                store.close()
        mem.buf.close()
        shutil.rmtree(dest, ignore_errors=True)
    return result
