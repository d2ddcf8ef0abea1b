"""Getting pages off flash before they are asked for: read-ahead staging (``readahead``). Landing them layer
by layer during the forward is an experiment (``experiments.layer_loader``).
"""

from sgl_kvtier.prefetch.readahead import ReadAhead, ReadAheadCounters

__all__ = ["ReadAhead", "ReadAheadCounters"]
