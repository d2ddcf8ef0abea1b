"""Store-level helpers of ``bench_store``, ``bench_backends`` and ``reliability``: the run context, fio, the
host pool, store factories, the index measures, SGLang's backends driven as its controller drives them, the
read-ahead load span, and the crash harness."""
