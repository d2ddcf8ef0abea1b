"""SGLang hooks of the streamed tail, registered all together by ``experiments.streaming.plugin``.

``bind`` (which hits stream), ``admit`` (register, gate, virtual hit, load-back, ownership, abort), ``slots``
(withheld host slots, reap, reset / detach), ``load`` and ``copy`` (the tail loader, the per-layer gate, the
verdict), ``retract`` (retract and requeue), ``sample`` and ``batch_marks`` (prefill samples around streamed
batches), ``accounting`` (SGLang's prefetch counters) and ``core`` (shared state and helpers).
"""
