"""SGLang general plugins (``sglang.srt.plugins`` entry points), loaded early in every SGLang process.

- ``cpu`` (entry point ``kvtier_cpu_shims``): the opt-in CPU shims of ``cpu_shims``;
- ``prefetch`` (entry point ``kvtier_prefetch``): the load-or-recompute stop decision;
- ``layer_loader`` (entry point ``kvtier_layer_loader``, ``KVTIER_LAYER_LOADER=1``): on CPU, HiCache load-backs
  copied layer by layer on a loader thread while the forward waits per layer (its gate:
  ``sgl_kvtier.prefetch.layer_gate``).

Invariant: importing this package, or a plugin module, imports nothing heavy (no torch, no SGLang class);
each ``load()`` returns at once unless its switch is set in the environment.
"""
