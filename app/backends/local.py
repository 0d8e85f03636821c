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
from gpu_runtime.contract import RuntimeOptions
from gpu_runtime.worker_client import WorkerClient


class LocalBackend:
    def __init__(self, settings: Settings) -> None:
        self.client = WorkerClient(
            data_dir=str(settings.data_dir),
            device=settings.device,
            options=RuntimeOptions(max_batch_size=settings.max_batch_size),
            allow_downloads=settings.allow_downloads,
            log_path=str(settings.worker_log) if settings.worker_log else None,
        )
        # The worker runs one call at a time anyway; holding this across a call also makes
        # "is the worker still the one that holds our state?" a question with a stable answer.
        self._lock = threading.Lock()
        self._started = False

    async def start(self) -> None:
        await anyio.to_thread.run_sync(self._start)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        # Not cancellable on purpose: a call the worker has taken finishes and is recorded.
        return await anyio.to_thread.run_sync(functools.partial(self._call, method, params))

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self.client.close)

    def _start(self) -> None:
        with self._lock:
            self.client.start()
            self._started = True

    def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._started and not self.client.alive:
                # It died between calls: un-applied gradients went with it, so say so rather than
                # quietly continuing on a fresh worker.
                self.client.restart()
                raise WorkerFailed(
                    f"the worker process died before {method}; a new worker has started and runs resume "
                    "from their last saved step (gradients not yet applied by optim_step were lost)"
                )
            try:
                result = self.client.call(method, **params)
            except WorkerFailed:
                self.client.restart()
                raise
            self._started = True
            return result
