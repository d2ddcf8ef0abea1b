"""``sgl-kvtier plan``: will KV offload pay for a workload, and how large a pool.

A request trace (``trace``) replayed through a model of the tiers (``tiers``, ``replay``): HBM and host
pools per instance, the L3 per instance or one shared pool, each evicting with the store's own policy on a
simulated clock, no IO. Prefill time comes from a fitted or roofline model (``model``), load time from the
array's bandwidth and latency; ``report`` turns the outcomes into a table, a PNG and one sentence of advice.
"""
