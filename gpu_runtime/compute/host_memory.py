"""The C allocator's settings for a runtime that computes on the CPU: freed memory is kept for the next pass.

By default glibc hands a freed block over its mmap threshold (128 KiB at first) straight back to the OS, and trims
the heap's top once 128 KiB lie free there. A CPU runtime's pass allocates and frees the same activations and
gradients every time, so every pass faulted them in again, page by page: with freed memory kept, a co-batched
training round of 8 runs on SmolLM2 took 7-9% less time, and one run's 5% (bench/cobatch.py, one thread). The
price is the one a CUDA caching allocator pays too: the process holds on to its high-water mark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("signal.runtime")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for it: blocks above (a pass's logits) are still mapped each time
TOP_PAD = 1 << 30  # address space reserved past each heap extension: untouched pages cost no memory
TRIM_THRESHOLD = 2**31 - 1  # the most an int holds: the top is trimmed only once 2 GiB lie free there


def keep_freed_memory() -> bool:
    """Tune glibc's malloc so freed blocks stay in the heap for reuse; False where this is not glibc (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    applied = all(mallopt(parameter, value) == 1 for parameter, value in settings)
    if not applied:
        log.warning("could not tune the C allocator (mallopt refused): CPU passes fault their memory in anew")
    return applied
