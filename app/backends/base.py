"""What every backend is: the protocol the services call, the answer type a call names and a streamed sample's
progress handler. Its own module, so that each backend imports it without importing the package that chooses one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from gpu_runtime.client.allocation import PoolKey
from gpu_runtime.contract import Call, Result, SampleChunk

A = TypeVar("A", bound=Result)  # the answer type a request names (Call[A])
Progress = Callable[[SampleChunk], None]


class Backend(Protocol):
    shares_disk: bool  # whether the runtime's files are on this server's disk (Modal's are on its Volume)
    label: str  # the backend in words, as the admin page names it
    allocates: bool  # whether a run's gpu_config picks the hardware it trains on (the local runtime has one device)

    @property
    def ready(self) -> bool: ...  # the runtime answers calls (until then they wait)

    @property
    def health(self) -> str: ...  # /healthz's status: warming, ok, busy, unresponsive or down (memory only)

    async def start(self) -> None: ...  # begins starting the runtime; returns at once

    # `request`'s answer, parsed with its result type. `pool`: the run's pool (gpu_runtime.client.allocation.PoolKey), None
    # for calls on no run. On Modal it picks the container; the local runtime is one pool for the whole machine
    # and ignores it. `progress`: a streamed sample's SampleChunks, called on the event loop before the call returns
    # (Modal calls it never: the result is all). `ticket`: the call's place in its run's order (scheduler.py).
    async def call(self, request: Call[A], pool: PoolKey | None = None, progress: Progress | None = None,
                   ticket: int | None = None, sent: Callable[[], None] | None = None) -> A: ...

    async def close(self) -> None: ...
