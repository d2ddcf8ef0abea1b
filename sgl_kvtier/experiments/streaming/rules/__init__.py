"""The streamed tail's decisions as pure functions (no SGLang, no torch, no clock: callers pass figures in).

``bind``: stream a hit or load it whole, and the figures it learns; ``gate``: when a streaming tail is admitted
(T_hide); ``read_groups``: how a tail is cut into read groups and how long a forward waits on such a read.
"""
