"""Keep freed host memory in the process, so a CPU training step does not page-fault its tensors in afresh.

glibc hands freed memory back to the kernel (heap trimming, and an mmap per block over its threshold), so
every pass's activations and every run's gradients come back as fresh pages the kernel must fault in and
zero: ~65 ms per 125 MB on this project's CPU, and 8 co-batched runs' gradients are 8x one run's (measured
by bench/cobatch.py's co-batched round: 32k minor faults per pass against 0 with this set). PyTorch's
CPU allocator is plain malloc, so the fix is malloc's: blocks up to the largest mmap threshold come from
the heap, and the heap is not trimmed: a process's resident memory stays at its high-water mark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): bigger blocks still map
TRIM_THRESHOLD = 2**30  # in effect never: the heap's top is given back only past 1 GiB free


@cache
def keep_freed_host_memory() -> bool:
    """Set malloc's thresholds once per process (glibc on Linux only); whether they were set."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): its allocator keeps its own policy
        return False
    # Both together: setting either one alone turns off glibc's dynamic threshold and leaves the mmap one at 128 KiB.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
