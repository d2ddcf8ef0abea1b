"""The SGLang adapter: the HiCache L3 backend ``KVTierStorage`` (``storage``; its host pools' page-store
shards in ``host_shard`` / ``host_shards``, with ``host_pages``, ``side_pools``, ``settings``, ``stats``),
SGLang's general plugins (``plugins``) and what several plugins share (``prefill_samples``).

Only this package and ``sgl_kvtier.experiments`` import sglang or torch; this package loads an experiment only
by name, through ``plugins.load``. Nothing is imported eagerly: SGLang runs the ``kvtier`` entry point
(``sgl_kvtier.sglang.plugins:load``) in every one of its processes, so this package must stay cheap to import.
``KVTierStorage`` is resolved on first access, which is how SGLang's ``dynamic`` backend factory reaches it
(``getattr(module, "KVTierStorage")``).
"""

from typing import Any

__all__ = ["KVTierStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVTierStorage":
        from sgl_kvtier.sglang.storage import KVTierStorage

        return KVTierStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
