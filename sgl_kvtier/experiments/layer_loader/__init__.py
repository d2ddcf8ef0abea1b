"""Layer-pipelined host -> device load-backs on CPU engines (``KVTIER_LAYER_LOADER=1``).

``layer_gate``: a per-layer gate and a layer-by-layer load on a loader thread (pure threading, reused by the
streamed tail's loader); ``plugin``: the SGLang hooks that run HiCache's load-back loop on that thread.
"""
