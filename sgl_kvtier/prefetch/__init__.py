"""Getting pages off flash before they are asked for: read-ahead staging (``readahead``)."""

from sgl_kvtier.prefetch.readahead import ReadAhead, ReadAheadCounters

__all__ = ["ReadAhead", "ReadAheadCounters"]
