"""One writer's shard of a namespace on flash: on-disk format, devices, slots, journal, checkpoint, index.

Entry points (import them from their modules; this init imports nothing, so loading a bytes-only module
such as ``store.format`` loads nothing else):
    ``sharing.sites.open_writer(config, namespace)``  one writer, a ``store.page_store.PageStore`` opened
                                                      on its config's ``store.site.WriterSite``
    ``sharing.follower.PageReader.open(config, namespace, wid=)``  a read-only view following one writer
    ``sharing.pool.SharedPool.open_writer`` / ``open_reader``      the merged view over every writer
    ``sharing.views.open_view(config, namespace, writer)``   what the adapter holds: that merged view, or
                                                      under ``sharing = "off"`` the one writer alone
All of them share the verified read path of ``store.shard.PageShard``.
"""
