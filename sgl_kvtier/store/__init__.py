"""The flash page store: devices, slots, journal, checkpoint and the PageStore facade."""

from sgl_kvtier.store.page_store import PageStore

__all__ = ["PageStore"]
