"""Getting pages off flash before they are asked for: read-ahead staging (``readahead``); and landing them
layer by layer while the forward runs: a per-layer gate and a loader thread (``layer_gate``)."""

from sgl_kvtier.prefetch.readahead import ReadAhead, ReadAheadCounters

__all__ = ["ReadAhead", "ReadAheadCounters"]
