"""The flash page store: bytes on disk (``format``), devices, slots, journal and checkpoint, the index.

Entry points (import them from their modules; this package init imports nothing, so that loading a
bytes-only module such as ``store.format`` does not load the rest):
    ``store.page_store.PageStore.open(config, namespace)``   the shard's one writer (takes its lock)
    ``store.reader.PageReader.open(config, namespace)``      a read-only view following the writer
Both share the verified read path of ``store.shard.PageShard``.
"""
