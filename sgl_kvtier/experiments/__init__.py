"""Opt-in features on top of the L3 store, each an SGLang general plugin behind its own switch.

The one ``kvtier`` entry point (``sgl_kvtier.sglang.plugins``) loads a room only when its environment variable
is set; the adapter (``sgl_kvtier.sglang``) imports none of them:

- ``streaming``: streamed L3 tails (``KVTIER_STREAM=1``);
- ``cost_policy``: the load-or-recompute prefetch stop decision (``KVTIER_PREFETCH_POLICY=cost``);
- ``layer_loader``: layer-by-layer host -> device load-backs on CPU engines (``KVTIER_LAYER_LOADER=1``).

None imports another but ``streaming``, whose tails load through ``layer_loader``'s per-layer gate (one way).
What two of them need is the adapter's (``sgl_kvtier.sglang.prefill_samples``, ``storage.Extension``).
"""
