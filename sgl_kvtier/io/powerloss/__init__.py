"""Power-loss fault mode (testing only): record every file operation under a directory, then build the
states a power cut could leave, ALICE / LazyFS / FaultInjectionTestFS style. Never used in production.

``Recorder(root)`` (``recorder.py``) replaces the ``os`` functions the store writes through (``open`` with any flags,
O_CREAT / O_TRUNC / O_DIRECT included, ``write``, ``writev``, ``pwrite``, ``pwritev``, ``ftruncate``,
``truncate``, ``posix_fallocate``, ``fsync``, ``fdatasync``, ``sync``, ``rename``, ``replace``, ``link``,
``unlink``, ``remove``, ``mkdir``, ``rmdir``, ``close``) while installed. Every call goes to the real
filesystem, and each one on a path or descriptor under ``root`` is also logged in one global order (the
calls run under one lock, so the log is a serial history the threads really produced; a sync covers
exactly the log entries before it). Files are tracked as nodes (inodes): a descriptor names a node, a
rename moves a directory entry, never data. ``mark(label, payload)`` logs what the workload knows at
that point (e.g. "these pages were acknowledged"). Files under ``root`` written around the wrappers
(``open()`` builtin, mmap) are adopted as they are on disk when first opened through ``os.open``
(counted in ``Recording.adopted``): a recording is only as complete as the wrapped calls.

Use (the store's suites: ``tests/store/test_powerloss.py``, ``benchmarks/powerloss.py``)::

    with Recorder(root) as rec:          # root: the store's directory (empty, or its state so far)
        ... run the workload; rec.mark("ack", ...) after each acknowledged call ...
    for cut in stratified_cuts(rec.recording, 40, rng):
        tree = build(rec.recording, cut, random_policy(rng), rng)
        materialize(tree, scratch / str(cut))   # then open the store there and check it

The model of a cut at log position ``cut`` (entries ``[0, cut)`` happened, nothing after), ``build``
(``state.py``):
  * Data (writes, truncates, fallocate size changes) of a file is durable once a later completed
    ``fsync`` or ``fdatasync`` of that file (any descriptor of its node), or ``os.sync()``, precedes the
    cut. ``fdatasync`` is taken as ``fsync`` for data and size: Linux flushes the size a later read
    needs (fallocate'd size included); timestamps are not modelled.
  * A directory entry (create, mkdir, link, unlink, rmdir, rename/replace within one directory) is
    durable once a later completed ``fsync`` of that directory precedes the cut. A file's own fsync
    never makes its entry durable. A rename across directories is two operations, an add in the target
    directory and a removal in the source, each durable with its own directory.
  * Everything not durable at the cut is resolved by the ``CutPolicy``: data ``drop`` (all lost),
    ``keep`` (all landed: a process crash), ``torn`` (each write lands as a random subset of its
    ``granularity``-aligned chunks, 512 B or 4 KiB, sizes kept or lost at random) or ``reorder`` (a
    random subset of whole writes lands, in order: later writes without earlier ones); namespace
    ``drop``, ``keep`` or ``prefix`` (a random prefix of the unsynced entry operations, in log order,
    as a journaling filesystem commits metadata). Choices come from the seeded RNG only.
  * A path survives only if every directory above it survives: a new file or directory whose entry is
    lost is lost with all its data, whatever was synced inside it. ``root`` itself always survives.
  * O_DIRECT writes are volatile like buffered ones (they sit in the device's write cache until a
    flush, which fsync/fdatasync issue), unless ``Recorder(direct_durable=True)``: a device with
    power-loss protection, where an O_DIRECT write is durable when it returns (its entry still is not).
Invariants: the state a ``keep``/``keep`` policy builds equals the directory as it is after the last
logged entry (when nothing outside the wrappers wrote under ``root``); ``build`` never reads the real
directory, only the initial snapshot and the log, so any number of cuts can be built from one run.
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
