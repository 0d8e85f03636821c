"""A streamed sample's decode chunks as they come: what /v1 and the playground's stream both read, around the one
RunService.sample call (its `progress` callback fills the queue)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from app.errors import SignalError
from gpu_runtime.contract import SampleChunk

log = logging.getLogger("signal.deadlines")  # where a withdrawn call's compute seconds are logged (deadlines.py)
T = TypeVar("T")
_BACKGROUND: set[asyncio.Future[Any]] = set()  # samples and cancels that outlive their stream: held till done


def hold(work: Awaitable[Any]) -> asyncio.Future[Any]:
    """`work` as a task kept referenced until it ends (a bare task could be collected mid-run)."""
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


async def next_chunk(task: asyncio.Future[Any], chunks: asyncio.Queue[SampleChunk]) -> SampleChunk | None:
    """The next decode chunk, or None once the sample is answered and its chunks are all taken (its error raised)."""
    if chunks.empty() and not task.done():
        getter = asyncio.ensure_future(chunks.get())
        try:
            await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
    if not chunks.empty():
        return chunks.get_nowait()
    task.result()  # the sample's error, if it failed
    return None


async def gone(receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> None:
    """Return once the client has gone away (its request body already read: what comes next is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def first_or_gone(task: asyncio.Future[Any], chunks: asyncio.Queue[SampleChunk],
                        receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> tuple[bool, SampleChunk | None]:
    """A stream's first chunk (as `next_chunk`), or (False, None) if its client goes away before it comes: a stream
    answered only once its first chunk is there would otherwise never notice, and the sample would run to its end."""
    first = asyncio.ensure_future(next_chunk(task, chunks))
    leaving = asyncio.ensure_future(gone(receive))
    try:
        await asyncio.wait([first, leaving], return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaving.cancel()
    if not first.done():
        first.cancel()
        return False, None
    return True, first.result()


async def unless_gone(call: Awaitable[T], gone: asyncio.Future[None], cancel: Callable[[], Awaitable[Any]],
                      what: str) -> T:
    """`call`'s answer; if its client goes away first (`gone`, shared by the request's fields), `cancel` is sent (held:
    it outlives the request) and `call` is still awaited: withdrawn, it raises CANCELLED (deadlines.answered logs its
    compute seconds); applied or answered already, it is recorded as usual."""
    task = asyncio.ensure_future(call)
    either: list[asyncio.Future[Any]] = [task, gone]
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        log.info("%s: its client went away; cancelling it", what)

        async def cancelled() -> None:
            try:
                await cancel()
            except SignalError as error:  # the call's own answer still comes
                log.warning("%s: the cancel after its client went away failed: %s", what, error)

        hold(cancelled())
    return await task
