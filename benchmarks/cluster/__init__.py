"""Helpers of ``bench_cluster``: the shared-filesystem lab (``lab``: JuiceFS mounted by several network
namespaces standing for hosts; the shared-pool tests build it too), the writer processes driven on its hosts,
and the report."""
