"""The local backend: one worker process on this machine, driven through gpu_runtime's client.

The client blocks, so every call runs in a thread and the event loop stays free.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import anyio.to_thread

from app.errors import WorkerFailed
from app.settings import Settings
from gpu_runtime.worker_client import WorkerClient


class LocalBackend:
    def __init__(self, settings: Settings) -> None:
        self.client = WorkerClient(
            data_dir=str(settings.data_dir),
            device=settings.device,
            max_batch_size=settings.max_batch_size,
            keep_steps=settings.keep_steps,
            allow_downloads=settings.allow_downloads,
            **({"log_path": str(settings.worker_log)} if settings.worker_log else {}),
        )
        self._restart_lock = threading.Lock()

    async def start(self) -> None:
        await anyio.to_thread.run_sync(self.client.start)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        try:
            # Not cancellable on purpose: a call the worker has taken finishes and is recorded.
            return await anyio.to_thread.run_sync(functools.partial(self.client.call, method, **params))
        except WorkerFailed:
            await anyio.to_thread.run_sync(self._replace_dead_worker)
            raise

    def _replace_dead_worker(self) -> None:
        # Another queued call may already have started a fresh worker; never kill a live one.
        with self._restart_lock:
            if not self.client.alive:
                self.client.restart()

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self.client.close)
