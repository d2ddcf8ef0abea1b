"""A writer's lease: ``LEASE`` rewritten every ``heartbeat_s`` (format in ``store.format``; the protocol
argument in docs/design/sharing.md).

Beat ``n`` (``counter = n``) rewrites block ``n % 2`` durably, so a beat torn by a crash leaves the other,
older block valid. A lease opened where one was counts on from that one's counter, never back to 0.
Fields: the writer's identity (wid, host_id, machine_id, boot_id, pid, ``incarnation`` fresh per open),
``counter``, ``heartbeat_s`` and its ``usage`` at that beat (pages, bytes, capacity, journal cursor, ages).
Where the blocks go (``LeaseBlocks``): the LEASE file (``store.meta.FileBlocks``) or a shared raw region's
LEASE area (``media.shared_raw.region_meta.AreaBlocks``, which also beats the host lease).

After each good beat ``after_beat`` (the pool's quota step) runs on the same thread, outside the beat's
lock. Fencing: before each write ``fence_check`` says whether a live writer of another host retired this
one; from then on the lease is ``fenced``, ``on_fenced`` runs once, and no beat writes or runs anything.
The check comes first, so a LEASE deleted under it (``ESTALE``) cannot hide the fence. A beat failing with
an error that says its descriptors are lost for good (``store.lost_handles``: the filesystem's client died)
stops the lease the same way, with that reason: the pool replaces the writer once the filesystem answers
again (``sharing.fencing``). ``start`` beats on
the ``kvtier-lease`` daemon thread, which never raises (failures are counted and logged); ``close`` stops
it and closes the blocks. ``read_lease`` only reads (a shared raw pool's path: from its region).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sgl_kvtier.errors import CorruptRecordError
from sgl_kvtier.io.threads import name_this_thread
from sgl_kvtier.media.shared_raw.regions import region_read
from sgl_kvtier.store import format as fmt
from sgl_kvtier.store.lost_handles import handle_lost, lost_reason
from sgl_kvtier.store.meta import FileBlocks, LeaseBlocks
from sgl_kvtier.telemetry.counters import RateLimitedLog

log = logging.getLogger(__name__)
THREAD_NAME = "kvtier-lease"
Usage = Callable[[], dict[str, Any]]


def read_lease(path: Path) -> dict[str, Any] | None:
    """The lease in ``path`` (a LEASE file), or None when it is missing or has no valid block."""
    try:
        with open(path, "rb") as f:
            data = f.read(2 * fmt.LEASE_BLOCK_BYTES)
    except OSError as exc:
        found = (region_read(path, fmt.REGION_LEASE_AT, 2 * fmt.LEASE_BLOCK_BYTES)
                 if exc.errno == errno.ENOTDIR else None)
        if found is None:
            return None
        data = found
    try:
        return fmt.unpack_lease(data, str(path))
    except CorruptRecordError:
        return None


class Lease:
    """The lease a writer beats (see the module docstring). ``identity``: the fixed fields; ``usage``:
    called at each beat for the changing ones."""

    def __init__(self, path: Path, identity: dict[str, Any], usage: Usage, interval_s: float,
                 clock: Callable[[], float] = time.monotonic, blocks: LeaseBlocks | None = None):
        self.path = path
        self.identity = dict(identity)
        self.usage = usage
        self.interval_s = interval_s
        self.clock = clock
        prior = read_lease(path)
        # Ordering: a lease reopened where one was (a restart into its own directory or region) counts on
        # above that one's last counter, so its first beat already wins over both older blocks
        # (``unpack_lease`` picks the higher counter); from 0, readers would see the previous incarnation for
        # one more beat, and a retirer that judged it dead would find that lease unchanged and fence anew.
        self.counter = 0 if prior is None else int(prior.get("counter", -1)) + 1
        self.failures = 0
        self.last_beat: float | None = None  # ``clock()`` at the last good beat
        self.after_beat: Callable[[], None] | None = None  # run after each good beat (see the module docstring)
        self.fence_check: Callable[[], str | None] | None = None  # why this writer is fenced, or None
        self.on_fenced: Callable[[str], None] | None = None  # run once when ``fence_check`` first says why
        self.fenced: str | None = None  # why the lease stopped (``fence_check``'s reason)
        self._lock = threading.Lock()  # one beat at a time (the thread's and a direct call)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._errlog = RateLimitedLog(log)
        self._blocks: LeaseBlocks | None = FileBlocks(path) if blocks is None else blocks

    def beat(self) -> None:
        """Write the next lease block now (pwrite + fdatasync), then run ``after_beat``. Raises OSError if
        the write fails (``after_beat`` is then skipped), or what ``after_beat`` raises. A fenced lease
        does nothing (see the module docstring)."""
        if self._is_fenced():
            return
        if self._write_beat() and self.after_beat is not None:
            self.after_beat()

    def _is_fenced(self) -> bool:
        with self._lock:
            if self.fenced is not None:
                return True
            check = self.fence_check
            reason = None if check is None or self._blocks is None else check()
            if reason is None:
                return False
            self.fenced = reason
        self._stopped(reason)
        return True

    def _stopped(self, reason: str) -> None:
        """The lease was just fenced (``self.fenced``, set under the lock): say so, and tell the pool."""
        log.warning("%s: this writer was fenced (%s); it writes nothing more in %s", self.path, reason,
                    self.path.parent)
        if self.on_fenced is not None:
            self.on_fenced(reason)

    def _lost(self, exc: OSError) -> None:
        """A beat showed the lease's descriptors lost for good: fenced with that reason (module docstring)."""
        reason = lost_reason(exc)
        with self._lock:
            if self.fenced is not None:
                return
            self.fenced = reason
        self._stopped(reason)

    def _write_beat(self) -> bool:
        with self._lock:
            if self._blocks is None:
                return False
            fields = {**self.identity, **self.usage(), "counter": self.counter, "heartbeat_s": self.interval_s}
            block = fmt.pack_lease_block(fields)
            # Crash rule: only block ``counter % 2`` is rewritten, so a torn beat leaves the previous lease.
            self._blocks.write_block(self.counter % 2, block)
            self.counter += 1
            self.last_beat = self.clock()
            return True

    def start(self) -> None:
        """Beat once now, then every ``interval_s`` on the ``kvtier-lease`` daemon thread."""
        self._safe_beat()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        name_this_thread()
        while not self._stop.wait(self.interval_s):
            self._safe_beat()

    def _safe_beat(self) -> None:
        try:
            self.beat()
        except Exception as exc:  # noqa: BLE001 - the thread must live on; the next beat retries
            self.failures += 1
            if isinstance(exc, OSError) and handle_lost(exc):
                self._lost(exc)  # no beat can ever succeed through these descriptors
                return
            self._errlog.error("%s: lease beat failed: %r", self.path, exc)

    def close(self) -> None:
        """Stop the beat thread (waiting for a beat in progress), then close its blocks. Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            blocks, self._blocks = self._blocks, None  # detached first: closed once
        if blocks is not None:
            blocks.close()
