"""Helpers of `benchmarks/bench_serving.py`: workloads, server configurations, the HTTP client, the report.

Nothing here imports SGLang: servers run in their own processes (`sgl_kvtier.sglang.server.SGLangServer`).
"""
