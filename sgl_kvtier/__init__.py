"""sgl-kvtier: an NVMe / NVMe-oF flash tier for SGLang HiCache."""

__version__ = "0.1.0"
