"""SGLang general plugins (``sglang.srt.plugins`` entry points), loaded early in every SGLang process.

- ``cpu`` (entry point ``kvtier_cpu_shims``): the opt-in CPU shims of ``cpu_shims``;
- ``prefetch`` (entry point ``kvtier_prefetch``): the load-or-recompute stop decision.

Invariant: importing this package, or a plugin module, imports nothing heavy (no torch, no SGLang class);
each ``load()`` returns at once unless its switch is set in the environment.
"""
