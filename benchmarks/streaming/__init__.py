"""bench_streaming's parts (an L3 hit's tail streamed in layer groups while its prefill runs):
the cells and servers of a run and the break-even device (``plan``), the rounds each server serves
(``rounds``), the streaming counters read off a server (``counters``), the on/off output comparison
(``outputs``), and the report and plot (``report``). Nothing here imports SGLang or torch.
"""
