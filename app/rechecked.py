"""Long-lived streams that keep re-checking the credential that opened them.

A credential is checked when a stream opens; a stream can then run for hours. `rechecked(events, interval, check)`
awaits `check()` every `interval` seconds, also while the stream waits for its next event, and ends the stream with
whatever `check` raises. Both front ends use it: the dashboard's event streams (web/session_streams.py, which
turns the end into a `signed-out` event) and the GraphQL subscriptions (app/schema/subscription.py, whose client
reads the raised UNAUTHENTICATED).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def rechecked(events: AsyncIterator[T], interval: float,
                    check: Callable[[], Awaitable[object]]) -> AsyncIterator[T]:
    """`events`, with `check()` awaited at least every `interval` seconds; an exception from it ends the stream
    (the inner stream is closed first) and propagates to the reader."""
    loop = asyncio.get_running_loop()
    checked = loop.time()
    iterator = aiter(events)
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            # The inner stream may wait long for its next event: wait for it at most until the next check is due.
            done, _ = await asyncio.wait({pending}, timeout=max(0.0, checked + interval - loop.time()))
            if done:
                try:
                    event = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                yield event
            if loop.time() - checked >= interval:
                await check()
                checked = loop.time()
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
