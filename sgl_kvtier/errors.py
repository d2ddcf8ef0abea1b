"""Typed exceptions of sgl-kvtier.

Internals raise these; exactly two kinds of boundary catch them and turn them into values: IO worker
threads (a failed page becomes ``False``) and the SGLang adapter (a miss, a ``False`` or a prefix count).
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every error sgl-kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is invalid. The message starts with the field's name."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class DeviceError(KVTierError):
    """A device path is missing, unwritable, too small or not what the store expects."""


class StoreFormatError(KVTierError):
    """On-disk data has another format version or geometry than this store expects."""


class StoreLockedError(KVTierError):
    """Another process holds the writer lock of this namespace shard."""


class StoreClosedError(KVTierError):
    """The store was used after ``close()``."""


class CorruptRecordError(KVTierError):
    """A journal, checkpoint or header record failed its checksum or could not be decoded."""


class PageSizeError(KVTierError, ValueError):
    """The buffer runs given for a page do not add up to the store's page size."""
