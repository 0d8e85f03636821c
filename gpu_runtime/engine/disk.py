"""A full disk, told apart from other write failures, and the guard that refuses writes until space is back.

torch reports a full disk as `RuntimeError: ... unexpected pos`, not ENOSPC, so a failed write is classed by the
free space left (statvfs), with ENOSPC/EDQUOT as a second sign. The message says the server's disk is full; the data
directory's path goes to the log only.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

from gpu_runtime.errors import ResourceExhausted

FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# How old a free-space reading a writing call's submit may use: each tick reads it afresh, and the calls submitted
# between ticks (8 runs' optim_steps) share that reading instead of one statvfs each.
FREE_SPACE_FRESH_S = 0.05
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


class FreeSpace:
    """Whether the disk under `path` has less than a margin free, read by statvfs at most once per FREE_SPACE_FRESH_S
    (or when asked `fresh`). Read from transports' threads and the tick's: a race costs one extra statvfs, no more."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._read_at = -FREE_SPACE_FRESH_S
        self._free = 0

    def below(self, margin_bytes: int, *, fresh: bool = False) -> bool:
        now = time.monotonic()
        if fresh or now - self._read_at >= FREE_SPACE_FRESH_S:
            self._free, self._read_at = free_bytes(self.path), now
        return self._free < margin_bytes
