"""Dashboard event streams that end with their session.

`until_signed_out(request, events)` wraps any stream's event generator: it re-checks the request's session every
SIGNAL_SESSION_RECHECK_S (at most 15 s) and, once the session is revoked, expired or its user disabled, sends
`event: signed-out` and ends. The re-checking is app/rechecked.py, which the GraphQL subscriptions share. Pages
close such a stream with the htmx SSE extension's `sse-close="signed-out"` (static/app.js then says "Signed out"):
without it the extension reconnects forever.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request

from app.rechecked import rechecked
from app.services import services_of
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
    services = services_of(request)
    sid = session_id(request)

    async def check() -> None:
        if await services.sessions.live(sid, touch=False) is None:
            raise _SignedOut

    try:
        async for event in rechecked(events, services.settings.session_recheck_s, check):
            yield event
    except _SignedOut:
        yield signed_out_event()


class _SignedOut(Exception):
    """Raised by the re-check; never leaves this module."""
