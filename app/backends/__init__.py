"""GPU runtimes the server can drive. Each takes the contract's typed requests and answers its typed results
(gpu_runtime.contract), and carries them as the plain data of DESIGN.md's engine contract."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from app.settings import Settings
from gpu_runtime.allocation import PoolKey
from gpu_runtime.contract import Call, Result, SampleChunk

A = TypeVar("A", bound=Result)  # the answer type a request names (Call[A])
Progress = Callable[[SampleChunk], None]


class Backend(Protocol):
    shares_disk: bool  # whether the runtime's files are on this server's disk (Modal's are on its Volume)

    @property
    def ready(self) -> bool: ...  # the runtime answers calls (until then they wait)

    @property
    def health(self) -> str: ...  # /healthz's status: warming, ok, busy, unresponsive or down (memory only)

    async def start(self) -> None: ...  # begins starting the runtime; returns at once

    # `request`'s answer, parsed with its result type. `pool`: the run's pool (gpu_runtime.allocation.PoolKey), None
    # for calls on no run. On Modal it picks the container; the local runtime is one pool for the whole machine
    # and ignores it. `progress`: a streamed sample's SampleChunks, called on the event loop before the call returns
    # (Modal calls it never: the result is all). `ticket`: the call's place in its run's order (scheduler.py).
    async def call(self, request: Call[A], pool: PoolKey | None = None, progress: Progress | None = None,
                   ticket: int | None = None, sent: Callable[[], None] | None = None) -> A: ...

    async def close(self) -> None: ...


def check_backend(settings: Settings) -> None:
    """Refuse now, before serving, a backend that cannot work: SIGNAL_BACKEND=modal without Modal credentials."""
    if settings.backend == "modal":
        from app.backends.modal import check_credentials

        check_credentials()


def make_backend(settings: Settings) -> Backend:
    if settings.backend == "local":
        from app.backends.local import LocalBackend

        return LocalBackend(settings)
    if settings.backend == "modal":
        from app.backends.modal import ModalBackend

        return ModalBackend(settings)
    raise ValueError(f"SIGNAL_BACKEND={settings.backend!r} is not available; this server has: local, modal")
