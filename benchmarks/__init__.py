"""sgl-kvtier's benchmark scripts, run from the repository root as ``python -m benchmarks.<name>``.

Scripts: ``bench_store``, ``bench_backends``, ``bench_serving``, ``bench_peers``, ``bench_policy``, ``bench_sharing``,
``bench_cluster``, ``bench_streaming``, ``bench_landing``, ``gpu_stream``, ``reliability``, ``powerloss``, ``soak``,
``kit_memory`` (the manual and the current results: ``docs/benchmarks/``). Scripts never import
each other: what they share lives in ``common`` (paths, page cache, scratch directories, progress, JSON),
``machine`` (the machine facts every result records), ``store/`` (store-level helpers), ``serving/``
(real-server helpers), ``peers/`` (bench_peers' systems, memory cgroups and overlay venv) and ``cluster/``
(the shared-filesystem lab and bench_cluster's workers).
"""
