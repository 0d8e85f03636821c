"""A full disk, told apart from other write failures, and the guard that refuses writes until space is back.

torch reports a full disk as `RuntimeError: ... unexpected pos`, not ENOSPC, so a failed write is classed by the
free space left (statvfs), with ENOSPC/EDQUOT as a second sign. The message says the server's disk is full; the data
directory's path goes to the log only.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

from gpu_runtime.errors import ResourceExhausted

FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
DISK_FULL_MESSAGE = "the server's disk is full: nothing of this call was applied; try again once space is freed"


def free_bytes(path: Path) -> int:
    while not path.exists() and path.parent != path:  # a data directory not made yet: the disk it will be on
        path = path.parent
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def is_disk_full(exc: BaseException, path: Path, margin_bytes: int) -> bool:
    if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
        return True
    try:
        return free_bytes(path) < margin_bytes
    except OSError:
        return False


def disk_full_error(path: Path, exc: BaseException | None = None) -> ResourceExhausted:
    print(f"disk full under {path} ({free_bytes(path)} bytes free): {exc or 'below the margin'}", file=sys.stderr)
    return ResourceExhausted(DISK_FULL_MESSAGE, resource="disk")
