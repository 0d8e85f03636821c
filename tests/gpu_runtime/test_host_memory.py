"""A CPU runtime keeps freed memory for its next pass (gpu_runtime/compute/host_memory.py; the speed-up is bench/cobatch.py's)."""

from __future__ import annotations

import platform
import sys

import pytest

from gpu_runtime.compute.host_memory import keep_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_takes_the_allocator_settings() -> None:
    assert keep_freed_memory() is True


@pytest.mark.skipif(sys.platform.startswith("linux"), reason="elsewhere than Linux")
def test_other_platforms_are_left_alone() -> None:
    assert keep_freed_memory() is False
