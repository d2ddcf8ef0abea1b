"""Errors that say a descriptor will never work again, whatever is retried through it (``handle_lost``).

A FUSE filesystem whose client process died (a JuiceFS mount killed) answers ENOTCONN on every descriptor
opened through it, and goes on doing so after the filesystem is mounted again at the same path: only a
fresh open reaches the new mount. JuiceFS answers EBADF on a descriptor of a file it can no longer write
(removed under it by another host); NFS answers ESTALE on a handle its server no longer knows. Such an error
belongs to the handle, not to the device, so the handle's holder opens the file afresh or gives it up:
  * a follower's segment read is retried through a fresh descriptor (``store.renewal``);
  * a writer's store, whose journal, lease and segments are all such handles, stops writing and is replaced
    by a writer in a fresh directory once the filesystem answers again (``sharing.fencing``).
"""

from __future__ import annotations

import errno

LOST_ERRNOS = frozenset({errno.ENOTCONN, errno.EBADF, errno.ESTALE})


def handle_lost(exc: BaseException | None) -> bool:
    """Whether ``exc`` is an OSError saying the descriptor (or handle) it came through is lost for good."""
    return isinstance(exc, OSError) and exc.errno in LOST_ERRNOS


def lost_reason(exc: OSError) -> str:
    """A few words for logs and the store's ``fenced``: which error showed the handles lost."""
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"its files can no longer be reached through its descriptors ({name})"
