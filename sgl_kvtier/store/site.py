"""Where one writer of a shard is placed and how it announces itself: the ``WriterSite`` that
``PageStore.open`` takes, chosen once from the config by ``sharing.sites.site_for`` (a directory or block
devices with a meta directory, or the shared raw device; and the sharing mode's checks and lease, if any).
The store reaches the medium and the sharing protocol only through it, so it imports neither.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from sgl_kvtier.keys import Namespace
from sgl_kvtier.store.layout import Layout


class Claim(Protocol):
    """A writer directory (or shared raw region) held by this process until ``release``."""

    wid: str
    host_id: str
    path: Path

    def release(self) -> None: ...


class Heartbeat(Protocol):
    """The lease a writer beats while open (``sharing.lease.Lease``), as the pool and quota drive it."""

    after_beat: Callable[[], None] | None
    fence_check: Callable[[], str | None] | None
    on_fenced: Callable[[str], None] | None
    fenced: str | None
    last_beat: float | None
    clock: Callable[[], float]

    def beat(self) -> None: ...
    def close(self) -> None: ...


class Closeable(Protocol):
    def close(self) -> None: ...


class Writer(Protocol):
    """What a site reads of the writer whose lease it starts (``PageStore``)."""

    wid: str
    claim: Claim
    incarnation: bytes
    layout: Layout

    def usage(self) -> dict[str, Any]: ...


class WriterSite(Protocol):
    """The medium and sharing mode of one writer, in the open order of ``store.writer_open``."""

    def check_storage(self) -> None:
        """What the sharing mode needs of the storage, before any file is made (raises naming the field)."""

    def meta_dir(self, namespace: Namespace) -> Path:
        """The namespace's meta directory (on the shared raw device: its name, no directory)."""

    def claim(self, namespace: Namespace, ns_meta: Path, wid: str | None) -> Claim:
        """Take a writer directory or region (``wid``: exactly that one of this host)."""

    def check_meta_present(self, namespace: Namespace, meta: Path, wid: str) -> None:
        """Refuse a writer place whose journal and checkpoint are gone while its slots hold pages."""

    def open_layout(self, namespace: Namespace, ns_meta: Path, wid: str, create: bool) -> Layout:
        """The writer's arenas and meta files, headers checked against the config."""

    def start_lease(self, store: Writer) -> tuple[Heartbeat | None, Closeable | None,
                                                   Callable[[], str | None] | None]:
        """The last step of the open, the store built: start beating ``store``'s lease. (The lease, or None
        for a writer that beats none (``sharing = "off"``); a host lease to close after it or None; why
        another machine took this host's slot or None.)"""
