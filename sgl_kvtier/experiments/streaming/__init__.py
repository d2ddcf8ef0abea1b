"""Streamed L3 tails: a hit's landed head is answered at once, the rest streams in under the forward.

At bind time (``hooks.bind``, ruled by ``rules.bind``) the backend's ``StreamingSide`` starts a ``TailStream``
that reads the hit's pages group-major, each read group verified, into the host slots SGLang allocated. SGLang
takes the landed head at once (``binding.StreamBinder.answer``); the rest becomes a ``StreamedTail`` whose host
slots are withheld from SGLang's release until its stream ended (``hooks.slots``). Once the T_hide gate
(``rules.gate``) admits it, the tail gets private device slots and a loader copies each group's layers into them
as the group lands, gating the forward's per-layer reads (``hooks.load``, ``hooks.copy``). A group that fails or
misses its deadline is zero-filled and the request is retracted after the forward and recomputes
(``hooks.retract``). ``contract`` holds the shared records and rules; ``plugin`` registers the hooks.
"""
