"""Streamed L3 tails (issue #13, "Route C" of ``../shared/reference/streaming-design.md``).

An L3 hit is split when SGLang's IO thread asks for it: the pages already landed and verified in their host
slots (the **head**) are answered True by ``batch_get_v1`` and go into the tree as today; the rest (the
**tail**) keeps streaming, layer group by layer group, into the host slots SGLang allocated for the hit.
The tail never enters the radix tree before its forward succeeded: its host slots are withheld from
SGLang's release, the request is admitted with the tail counted as a (virtual) host hit, and the tail is
copied group by group into device slots private to the request, each copy after that group landed and
verified on every tail page. A group that fails (IO error, checksum, deadline) puts zeros into the private
slots and the request is retracted after the forward and recomputes. No other request can read a tail.

Modules:
- ``contract``: the records shared by the parts (``TailStream`` protocol, ``StreamedTail``, ``TailState``,
  ``StreamRegistry``) and their invariants;
- ``tail_stream``: the backend side, group-major reads of a bound hit into its host slots;
- ``binding``: the backend's table of bound hits (slot binding, ``batch_get_v1``'s head/tail answer);
- the scheduler side is the plugin ``sgl_kvtier.sglang.plugins.stream`` (hooks; off unless the backend's
  ``streaming = "on"``).
"""
