"""SGLang-facing parts of sgl-kvtier: the L3 backend ``KVTierStorage``, the CPU plugin, a server runner
and a model factory for tests and benchmarks.

Only this package imports sglang. Nothing is imported eagerly: SGLang imports
``sgl_kvtier.sglang.cpu_plugin`` in every one of its processes through the ``sglang.srt.plugins`` entry
point, so this package must stay cheap to import. ``KVTierStorage`` is resolved on first access, which is
how SGLang's ``dynamic`` backend factory reaches it (``getattr(module, "KVTierStorage")``).
"""

from typing import Any

__all__ = ["KVTierStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVTierStorage":
        from sgl_kvtier.sglang.storage import KVTierStorage

        return KVTierStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
