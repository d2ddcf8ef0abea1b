"""Power-loss fault mode (testing only): record every file operation under a directory, then build the
states a power cut could leave (ALICE / LazyFS style).

``Recorder(root)`` (``recorder.py``) logs the ``os`` file calls under ``root`` in one global order while
installed; ``mark(label, payload)`` logs what the workload knows (e.g. "these pages were acknowledged").
``state.py`` builds the cut states::

    with Recorder(root) as rec:          # root: the store's directory (empty, or its state so far)
        ... run the workload; rec.mark("ack", ...) after each acknowledged call ...
    for cut in stratified_cuts(rec.recording, 40, rng):
        tree = build(rec.recording, cut, random_policy(rng), rng)
        materialize(tree, scratch / str(cut))   # then open the store there and check it

The model of a cut at log position ``cut`` (entries ``[0, cut)`` happened):
  * A file's data (writes, truncates, fallocate sizes) is durable once a later ``fsync``/``fdatasync`` of its
    node, or ``os.sync()``, completed before the cut. A directory entry (create, link, unlink, rename,
    mkdir, rmdir) is durable once a later ``fsync`` of its directory did; a file's own fsync never makes
    its entry durable, and a cross-directory rename is an add and a removal, each durable on its own.
  * The rest is resolved by the seeded ``CutPolicy``: data ``drop``, ``keep`` (a process crash), ``torn``
    (a random subset of each write's 512 B or 4 KiB chunks) or ``reorder`` (a random subset of whole
    writes); namespace ``drop``, ``keep`` or ``prefix`` (a prefix of the unsynced entry operations).
  * A path survives only with every directory above it; ``root`` always survives.
  * O_DIRECT writes are volatile until a flush, unless ``Recorder(direct_durable=True)`` (power-loss
    protection: durable on return; the entry still needs its directory's fsync).
Invariants: ``keep``/``keep`` rebuilds the directory as after the last entry (when nothing wrote around the
wrappers); ``build`` reads only the initial snapshot and the log, so one run yields any number of cuts.
"""

from __future__ import annotations

from sgl_kvtier.io.powerloss.recorder import Recorder, cut_states
from sgl_kvtier.io.powerloss.state import (
    CutPolicy,
    Entry,
    Recording,
    Tree,
    build,
    materialize,
    random_policy,
    stratified_cuts,
)

__all__ = ["CutPolicy", "Entry", "Recorder", "Recording", "Tree", "build", "cut_states", "materialize",
           "random_policy", "stratified_cuts"]
