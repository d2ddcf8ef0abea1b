"""Helpers of the real-server benchmarks (``bench_serving``, ``bench_policy``, ``soak``): workloads, server
configurations, policies, the HTTP client, the run frame, machine-side probes, and the reports.

Nothing here imports SGLang at module level: servers run in their own processes
(`sgl_kvtier.serving.server.SGLangServer`).
"""
