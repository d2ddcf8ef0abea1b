"""``sgl-kvtier verify``: does the L3 pay on this deployment? The same prompts, played against the deployment
with its L3 and against baselines without it (HiCache's host tier only; HBM only), at the concurrencies named,
measured at the client and judged against gates (TTFT p50 cut, throughput gain).

- ``gates``: the gates and their verdicts.
- ``arms``: what each arm serves from (running endpoints, or servers started from a ``launch`` config).
- ``runner``: the workload played on each arm, level by level.
- ``report``: table, markdown, PNG.
- ``cli``: the sub-command.
"""
