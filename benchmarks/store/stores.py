"""PageStore factories for the store-level benchmarks: one namespace and one config builder for all of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sgl_kvtier.config import StoreConfig
from sgl_kvtier.keys import Namespace
from sgl_kvtier.sharing.sites import open_writer
from sgl_kvtier.store.page_store import PageStore

SMALL_SEGMENT = 1 << 20  # small stores (reliability suites) use 1 MiB segment files


def namespace(page_bytes: int, page_tokens: int = 64, model: str = "bench") -> Namespace:
    """The namespace of a benchmark's pages: bf16, SGLang's ``page_first`` layout."""
    return Namespace(model, "bf16", "page_first", page_tokens, page_bytes)


def store_config(path: Path, capacity_bytes: int, **keys: Any) -> StoreConfig:
    """A config for one directory device, parsed as an operator's keys would be (``io_engine="uring"``, ...)."""
    return StoreConfig.from_mapping({"devices": [str(path)], "capacity_bytes": capacity_bytes, **keys})


def open_store(path: Path, page_bytes: int, capacity_bytes: int, page_tokens: int = 64, **keys: Any) -> PageStore:
    """Open (or create) the store of ``path`` for pages of ``page_bytes``."""
    return open_writer(store_config(path, capacity_bytes, **keys), namespace(page_bytes, page_tokens))
