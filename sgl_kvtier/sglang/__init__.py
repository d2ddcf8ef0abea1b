"""The SGLang adapter: the L3 backend ``KVTierStorage`` (``storage``, with ``pool_tier``, ``host_pages``,
``sidecars``, ``settings``, ``stats``) and SGLang's general plugins (``plugins``).

Only this package imports sglang or torch. Nothing is imported eagerly: SGLang imports
``sgl_kvtier.sglang.plugins.cpu`` and ``.prefetch`` in every one of its processes through the
``sglang.srt.plugins`` entry points, so this package must stay cheap to import. ``KVTierStorage`` is resolved on first access, which is
how SGLang's ``dynamic`` backend factory reaches it (``getattr(module, "KVTierStorage")``).
"""

from typing import Any

__all__ = ["KVTierStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVTierStorage":
        from sgl_kvtier.sglang.storage import KVTierStorage

        return KVTierStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
