"""The SGLang releases sgl-kvtier supports, and what differs between them.

Supported: 0.5.22 and 0.5.23, the releases the test suite runs on. Older releases are refused: their CPU path
cannot be tested (0.5.21 and older allocate paged KV through Triton), and they lack hook targets the plugins
need.

What the adapter meets across the range (everything else it calls is the same in both):
- ``HiCacheStorageConfig.is_storage_writer``: absent on 0.5.22, which elects the same writers by a rule
  inlined in its cache controller (``writer_of``);
- ``HiCacheStorage.on_host_pools_registered()``: absent on 0.5.22, where the host shards open on the first
  call that needs a store (``host_shards.HostShards.ready``);
- ``HiCacheStorageFailureInjector``: absent on 0.5.22 (looked up by name);
- the plugins' hook targets: each plugin lists the releases it is tested on (``plugins.PLUGINS``).

Invariant: imports no SGLang (only its installed version's metadata), so it is cheap wherever it is used.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from typing import Any

from sgl_kvtier import __version__
from sgl_kvtier.errors import KVTierError

SUPPORTED = ("0.5.22", "0.5.23")  # pyproject's extra ``sglang`` states the same range (tests/test_release.py)


class UnsupportedSGLangError(KVTierError):
    """The installed SGLang is outside the supported range (or not installed): the backend refuses to start."""


def release_of(version: str) -> str:
    """``"0.5.23"`` from ``"0.5.23"``, ``"0.5.23.post1"``, ``"0.5.23rc0"`` or ``"0.5.23+cpu"``."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a release version: {version!r}")
    return ".".join(match.groups())


@functools.cache
def installed() -> str | None:
    """The installed SGLang's version (None: not installed). Read once per process."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def supported_range() -> str:
    """The supported releases, for messages: ``"0.5.22 to 0.5.23"``."""
    return f"{SUPPORTED[0]} to {SUPPORTED[-1]}" if len(SUPPORTED) > 1 else SUPPORTED[0]


def check_supported(version: str | None = None) -> str:
    """The installed (or given) SGLang's release, if supported; else ``UnsupportedSGLangError`` naming both."""
    version = installed() if version is None else version
    release = None if version is None else release_or_none(version)
    if release in SUPPORTED:
        return str(release)
    found = "no SGLang is installed" if version is None else f"SGLang {version} is installed"
    raise UnsupportedSGLangError(
        f"{found}; sgl-kvtier {__version__} supports SGLang {supported_range()} "
        f"(pip install 'sglang>={SUPPORTED[0]},<={SUPPORTED[-1]}', or 'sgl-kvtier[sglang]')")


def release_or_none(version: str) -> str | None:
    """``release_of``, or None where ``version`` names no release."""
    try:
        return release_of(version)
    except ValueError:
        return None


def writer_of(storage_config: Any) -> bool:
    """Whether this rank writes its shard: SGLang's own election, on each supported release.

    0.5.23: ``is_storage_writer`` (rank-replicated MLA models: one writer per DCP shard, ``tp_rank ==
    dcp_rank``; others: every rank). 0.5.22 has no DCP and no property: its controller skips backups on
    rank-replicated models off TP rank 0, the same rule with ``dcp_rank`` 0.
    """
    elected = getattr(storage_config, "is_storage_writer", None)
    if elected is not None:
        return bool(elected)
    return not bool(storage_config.is_mla_model) or int(storage_config.tp_rank) == 0


__all__ = ["SUPPORTED", "UnsupportedSGLangError", "check_supported", "installed", "release_of", "release_or_none",
           "supported_range",
           "writer_of"]
