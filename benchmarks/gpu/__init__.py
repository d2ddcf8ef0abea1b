"""gpu_stream's parts (bench_streaming's GPU mode, plain torch, no SGLang): the page geometries and stand-in layer
shapes (``geometry``), the store and its host landing buffer (``kvstore``), the stand-in prefill
(``prefill``), the two timed paths (``pipeline``) and the report (``report``). ``torch`` is imported by the
modules that need it; the geometry and the report need none.
"""
