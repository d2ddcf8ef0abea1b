"""What the SGLang adapter holds of a namespace shard (``PoolView``), opened once from the config (``open_view``).

``sharing = "host"`` / ``"cluster"``: a ``sharing.pool.SharedPool``, the merged view over every writer of
the shard, with its lease, peers and quota. ``sharing = "off"``: a ``sharing.sole.SoleShard``, the shard's
one writer alone (or a reader following it). Both answer the same calls, so nothing above this module asks
which mode it runs under.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from sgl_kvtier.config import Sharing, StoreConfig
from sgl_kvtier.io.buffers import Run
from sgl_kvtier.keys import Namespace, PageKey
from sgl_kvtier.sharing.follower import PageReader
from sgl_kvtier.sharing.liveness import Judged
from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.sharing.sole import SoleShard
from sgl_kvtier.store.health import DeviceHealth
from sgl_kvtier.store.page_store import PageStore
from sgl_kvtier.store.part_reads import OnPart
from sgl_kvtier.store.read_rates import ReadRates
from sgl_kvtier.telemetry.counters import StoreStats


class PoolView(Protocol):
    """A namespace shard as one store: reads from whichever writer holds a page, writes to this process's
    own (``own``; None on a rank that only reads), figures over every writer it serves."""

    config: StoreConfig
    namespace: Namespace
    ns_meta: Path
    health: DeviceHealth
    read_rates: ReadRates

    @property
    def own(self) -> PageStore | None:
        """This process's writer (None: a reader)."""

    @property
    def writer(self) -> bool:
        """Whether ``put`` stores pages here."""

    def refresh(self, force: bool = False, wait_s: float = 0.0) -> bool:
        """Pick up what other processes wrote since (rate-limited unless ``force``); never raises."""

    def longest_prefix(self, keys: Sequence[PageKey]) -> int:
        """Leading ``keys`` held; a short answer re-reads the other writers first (``shortfall``)."""

    def present(self, keys: Sequence[PageKey]) -> list[bool]:
        """Whether each of ``keys`` is held (the view refreshed first, rate-limited)."""

    def shortfall(self, asked: Sequence[PageKey]) -> bool:
        """A lookup of ``asked`` fell short of it: re-read the other writers where ``sharing.shortfall``'s rule
        says so (a retry always); True if their pages changed, so the answer is to be made again."""

    def contains(self, key: PageKey) -> bool: ...
    def get(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]]) -> list[bool]: ...

    def get_parts(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]], on_part: OnPart,
                  groups: Sequence[Sequence[int]] | None = None) -> list[bool]: ...

    def put(self, keys: Sequence[PageKey], pages: Sequence[Sequence[Run]],
            parent: PageKey | None = None) -> list[bool]: ...

    def clear(self) -> int: ...
    def stats(self) -> StoreStats: ...

    def peers(self) -> Mapping[str, PageReader]:
        """The other writers followed now, by wid."""

    def leases(self) -> dict[str, dict[str, Any]]:
        """The other writers' last leases read, by wid."""

    def verdict(self, wid: str) -> Judged:
        """Whether writer ``wid`` is live, dead, retired or unknown, judged now."""

    def sharing_stats(self) -> dict[str, int]:
        """Running totals of ``telemetry.snapshot.SHARING_COUNTERS``."""

    def close(self) -> None: ...


def open_view(config: StoreConfig, namespace: Namespace, writer: bool) -> PoolView:
    """The view of ``namespace``'s shard under ``config.sharing`` (module docstring): as its writer (errors
    propagate: ``PageStore.open``'s), or read-only (DeviceError while no writer has made it: retry)."""
    if config.sharing is Sharing.OFF:
        return SoleShard.open_writer(config, namespace) if writer else SoleShard.open_reader(config, namespace)
    return SharedPool.open_writer(config, namespace) if writer else SharedPool.open_reader(config, namespace)
