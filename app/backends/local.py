"""The local backend: one runtime process on this machine, driven through gpu_runtime's pipelined client.

The runtime is the data directory's (`signal runtime`, on DATA_DIR/runtime.sock): every server process on
the machine connects to it. When none listens, the first call starts one, detached, and it exits once its
last server has gone; a second `signal runtime` or a racing server finds the lock taken and connects instead.

Many calls are in flight at once: each is a Future of the client, awaited here without a lock.
The runtime starts in the background, so the server answers (`/healthz`: warming) before it is ready;
calls made meanwhile wait for it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping

import anyio.to_thread

from app.backends.base import A, Progress
from app.settings import Settings
from gpu_runtime.client.allocation import PoolKey
from gpu_runtime.client.runtime_client import Answer, Chunks, RuntimeClient
from gpu_runtime.contract import Call, SampleChunk
from gpu_runtime.errors import SignalError

log = logging.getLogger("signal.backend")


class LocalBackend:
    shares_disk = True
    label = "local process"
    allocates = False  # every run trains on the runtime's one device, whatever allocation it asked for

    def __init__(self, settings: Settings) -> None:
        self.client = RuntimeClient(
            data_dir=str(settings.data_dir),
            device=settings.device,
            options=settings.runtime_options(),
            allow_downloads=settings.allow_downloads,
            log_path=str(settings.worker_log) if settings.worker_log else None,
            shared=True,
            threads=settings.threads,
        )
        self._starting: asyncio.Future[None] | None = None
        self.in_flight = 0  # calls taken and not yet answered (waiting for the runtime to start included)
        self.watch = Watch(settings.heartbeat_interval_s, settings.busy_tick_s, settings.unresponsive_s,
                           settings.restart_after_s)
        self._watching: asyncio.Task[None] | None = None

    @property
    def health(self) -> str:
        """warming, ok, busy (a tick running past busy_tick_s), unresponsive (no heartbeat past unresponsive_s) or
        down (no runtime): what /healthz says, from memory only."""
        if not self.ready:
            return "down" if self._starting is not None and self._starting.done() else "warming"
        if not self.client.alive:
            return "down"
        return self.watch.state()

    @property
    def ready(self) -> bool:
        starting = self._starting
        return starting is not None and starting.done() and not starting.cancelled() and starting.exception() is None

    async def start(self) -> None:
        """Begin starting the runtime and return at once; `ready` says when it is up. Then watch its heartbeat."""
        self._ensure_starting()
        self._watching = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        """Ask for a heartbeat every interval. Only a runtime this server started is restarted, and only after
        restart_after_s of silence: a busy tick still answers, so it is never taken for a hung one."""
        watch = self.watch
        while True:
            await asyncio.sleep(watch.interval_s)  # a period, not a wait for an event
            if not self.ready or not self.client.alive:
                continue
            beat = self.client.heartbeat()
            try:
                answer = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(beat)), watch.interval_s)
            except (TimeoutError, SignalError):
                self.client.forget(beat)
                if watch.silent_for() > watch.restart_after_s and self.client.started_by_us:
                    log.error("the GPU runtime has not answered a heartbeat for %.0f s: killing it; the next call "
                              "starts another, which restores every run from its journal", watch.silent_for())
                    await anyio.to_thread.run_sync(self.client.kill)
                    watch.reset()
                continue
            tick_seconds = answer.get("tick_seconds", 0.0)  # protocol.Heartbeat's
            watch.beat(float(tick_seconds) if isinstance(tick_seconds, (int, float)) else 0.0)

    async def call(self, request: Call[A], pool: PoolKey | None = None, progress: Progress | None = None,
                   ticket: int | None = None, sent: Callable[[], None] | None = None) -> A:
        # `pool` is ignored: this machine's runtime is one pool holding every base it is asked for.
        self.in_flight += 1
        try:
            await asyncio.shield(self._ensure_starting())
            if not self.client.alive:
                # It died since (the client would respawn it inside submit, blocking the event loop): respawn in a
                # thread. Nothing acknowledged is lost: the runtime restores runs from their journals.
                await anyio.to_thread.run_sync(self.client.start)
            # In a thread: a large batch can fill the pipe, and the write would block the event loop.
            future = await anyio.to_thread.run_sync(functools.partial(self._submit, request, _on_loop(progress), ticket))
            log.debug("%s sent to the runtime (run %s)", request.method, request.run)
            if sent is not None:
                sent()  # written to the runtime's connection, which it reads in order: the run's next call may go
            # Shielded: cancelling the caller must not cancel the client's Future, which the runtime still answers.
            # A WorkerFailed passes through; the next call starts a new runtime.
            answer = await asyncio.shield(asyncio.wrap_future(future))
            return request.result(answer)
        finally:
            self.in_flight -= 1

    def _submit(self, request: Call, handler: Chunks | None, ticket: int | None) -> Answer:
        # The request as the wire's arguments (the ticket beside them), made here in the sending thread.
        params = request.to_dict() | ({} if ticket is None else {"ticket": ticket})
        return self.client.send(request.method.value, handler, **params)

    async def close(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
        if self._starting is not None and not self._starting.done():
            await asyncio.wait([self._starting])
        await anyio.to_thread.run_sync(self.client.close)

    def _ensure_starting(self) -> asyncio.Future[None]:
        """The start in progress or done; a new one if none was made or the last one failed."""
        starting = self._starting
        if starting is None or (starting.done() and (starting.cancelled() or starting.exception() is not None)):
            starting = self._starting = asyncio.ensure_future(anyio.to_thread.run_sync(self.client.start))
            starting.add_done_callback(_report_failed_start)
            # Its grace period counts from when it is up: a slow start is not silence (/healthz "unresponsive").
            starting.add_done_callback(lambda _: self.watch.reset())
        return starting


class Watch:
    """The runtime's last heartbeat, read by /healthz (memory only) and by the restart rule."""

    def __init__(self, interval_s: float, busy_tick_s: float, unresponsive_s: float, restart_after_s: float) -> None:
        self.interval_s, self.busy_tick_s = interval_s, busy_tick_s
        self.unresponsive_s, self.restart_after_s = unresponsive_s, restart_after_s
        self.reset()

    def reset(self) -> None:
        self.last_beat, self.tick_seconds = time.monotonic(), 0.0  # a new runtime has its grace period

    def beat(self, tick_seconds: float) -> None:
        self.last_beat, self.tick_seconds = time.monotonic(), tick_seconds

    def silent_for(self) -> float:
        return time.monotonic() - self.last_beat

    def state(self) -> str:
        if self.silent_for() > self.unresponsive_s:
            return "unresponsive"
        return "busy" if self.tick_seconds > self.busy_tick_s else "ok"


def _on_loop(progress: Progress | None) -> Chunks | None:
    """The client calls its handler on its reader thread with a chunk as it came; the caller's `progress` gets it
    typed, on its event loop."""
    if progress is None:
        return None
    loop = asyncio.get_running_loop()

    def handed_over(chunk: Mapping[str, object]) -> None:
        loop.call_soon_threadsafe(progress, SampleChunk.from_dict(chunk))

    return handed_over


def _report_failed_start(starting: asyncio.Future[None]) -> None:
    # Said here, once, even when no call is waiting; the next call tries to start it again.
    if not starting.cancelled() and starting.exception() is not None:
        log.error("the GPU runtime did not start: %s", starting.exception())
