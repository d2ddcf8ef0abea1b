"""The flash page store: bytes on disk (``format``), devices, slots, journal and checkpoint, the index.

Entry points (import them from their modules; this package init imports nothing, so that loading a
bytes-only module such as ``store.format`` does not load the rest):
    ``sharing.pool.SharedPool.open_writer(config, namespace)`` the merged view over every writer of a
                                                            namespace, with a writer of its own (what the
                                                            adapter holds); ``open_reader``: without one
    ``store.page_store.PageStore.open(config, namespace)``   one writer (claims a ``w-<wid>`` directory)
    ``sharing.follower.PageReader.open(config, namespace, wid=)`` a read-only view following one writer
The shards share the verified read path of ``store.shard.PageShard``.
"""
