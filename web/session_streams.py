"""Dashboard event streams that end with their session.

`until_signed_out(request, events)` wraps any stream's event generator: it re-checks the request's session every
SIGNAL_SESSION_RECHECK_S (at most 15 s) and, once the session is revoked, expired or its user disabled, sends
`event: signed-out` and ends. Pages close such a stream with the htmx SSE extension's `sse-close="signed-out"`
(static/app.js then says "Signed out"): without it the extension reconnects forever.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request

from web.session import session_id

SIGNED_OUT = "signed-out"


def signed_out_event() -> ServerSentEvent:
    return ServerSentEvent(data="Your session has ended; sign in again.", event=SIGNED_OUT)


def wants_stream(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "")


def signed_out_stream() -> EventSourceResponse:
    """What a stream request without a live session gets: one `signed-out` event (a 200, so EventSource reads it;
    a redirect to the login page would only make it retry)."""

    async def once() -> AsyncIterator[ServerSentEvent]:
        yield signed_out_event()

    return EventSourceResponse(once())


async def until_signed_out(request: Request, events: AsyncIterator[ServerSentEvent]) -> AsyncIterator[ServerSentEvent]:
    """`events`, until the request's session ends; then one `signed-out` event."""
    services = request.app.state.services
    interval = services.settings.session_recheck_s
    sid = session_id(request)
    loop = asyncio.get_running_loop()
    checked = loop.time()
    iterator = aiter(events)
    pending: asyncio.Future[ServerSentEvent] | None = None
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
                if await services.sessions.live(sid, touch=False) is None:
                    yield signed_out_event()
                    return
                checked = loop.time()
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
