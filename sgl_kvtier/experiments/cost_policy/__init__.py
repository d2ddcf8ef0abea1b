"""The cost-model prefetch policy (``KVTIER_PREFETCH_POLICY=cost``).

``plugin`` replaces SGLang's static prefetch budget with the load-or-recompute decision
(``sgl_kvtier.policy.cost_model``) and samples the prefill speed that decision needs.
"""
