"""Rendering: one Jinja2 environment, full pages or htmx partials, and typed errors shown as a page or a toast."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.templating import Jinja2Templates

from app.errors import INTERNAL_STATUS, InternalError, NotFound, SignalError, http_status, retry_after_headers
from app.failures import known_failure
from app.services import Services, services_of
from web.paths import TEMPLATES
from web.session import csrf_token, current
from web.session_streams import signed_out_stream, wants_stream

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.tables import User

log = logging.getLogger("signal.web")
templates = Jinja2Templates(directory=str(TEMPLATES))

INTERNAL_MESSAGE = "Something went wrong on our side; it has been logged."


def ago(value: datetime | None) -> str:
    if value is None:
        return "never"
    seconds = (datetime.now(UTC) - value).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return "just now"


def _bytes(value: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"


def duration(value: timedelta) -> str:
    """A run's span from creation to its last activity: 45 s, 12 min, 3 h 5 min, 2 d 4 h."""
    seconds = int(value.total_seconds())
    if seconds < 60:
        return f"{max(seconds, 0)} s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if days:
        return f"{days} d {hours % 24} h"
    return f"{hours} h {minutes % 60} min" if hours else f"{minutes} min"


templates.env.filters.update(ago=ago, bytes=_bytes, duration=duration)
templates.env.filters["params"] = lambda n: f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def services(request: Request) -> Services:
    return services_of(request)


def is_htmx(request: Request) -> bool:
    return request.headers.get("hx-request") == "true"


def page(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    context.setdefault("user", None)
    settings = services(request).settings
    base = {"request": request, "csrf": csrf_token(request), "public_url": settings.resolved_public_url,
            "supabase": services(request).supabase is not None, "path": request.url.path,
            # whether a run's asked-for allocation is what it trains on (Modal) or moot (the local runtime's one device)
            "allocates": services(request).backend.allocates}
    return templates.TemplateResponse(request, name, {**base, **context}, status_code=status_code)


def error_response(request: Request, error: SignalError, user: User | None = None) -> Response:
    status = http_status(error)
    message = error.message if status != INTERNAL_STATUS else INTERNAL_MESSAGE
    if status == INTERNAL_STATUS:
        log.exception("dashboard error", exc_info=error)
    headers = retry_after_headers(error)  # a 429 (too many calls in flight) says when to come back
    if is_htmx(request):
        # htmx swaps nothing on errors: app.js shows this text in a toast.
        return Response(message, status_code=status, media_type="text/plain", headers=headers)
    response = page(request, "error.html", status_code=status, user=user, status=status, message=message)
    response.headers.update(headers)
    return response


async def failure_page(request: Request, exc: Exception) -> Response:
    """The dashboard's one mapping of what its handlers do not catch themselves: the database's failures (disk full,
    locked, read-only: app/failures.py) as the error page or toast with their status, never a plain 500."""
    error = known_failure(exc)
    if error is None:
        log.error("dashboard request failed", exc_info=exc)
        error = InternalError("internal error")
    return error_response(request, error)  # no sidebar: reading the session would ask the failing database again


async def not_found_page(request: Request, exc: Exception) -> Response:
    """A path no route matches, as the dashboard's 404 page (with the sidebar when signed in), or a toast's text.
    The path is not echoed: `/runs/%00` would print an escape, and the address bar already shows it."""
    live = await current(request, touch=False)
    return error_response(request, NotFound("There is no page at this address."), live.user if live else None)


Handler = Callable[[Request, "User"], Awaitable[Response]]


def signed_in(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint for `handler(request, user)`: signs the visitor in first, renders typed errors."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        live = await current(request)
        user = live.user if live is not None else None
        if user is None:
            if wants_stream(request):  # an EventSource: told to stop, not redirected (it would retry forever)
                return signed_out_stream()
            target = "/login?next=" + quote(here(request), safe="/")
            if is_htmx(request):
                return Response("Your session has ended; sign in again.", status_code=401,
                                headers={"HX-Redirect": target})
            return RedirectResponse(target, status_code=303)
        try:
            return await handler(request, user)
        except SignalError as error:
            return error_response(request, error, user)

    return endpoint


def here(request: Request) -> str:
    """This request's path and query: where a sign-in returns to."""
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def signed_in_or_key(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """As `signed_in`, and an API key (`Authorization: Bearer sk-…`) signs a program in too: the same URL serves
    the dashboard's links and the SDK's downloads. A program gets plain-text errors with their status."""
    browser = signed_in(handler)

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        header = request.headers.get("authorization")
        if not header:
            return await browser(request)
        try:
            scheme, _, secret = header.partition(" ")
            user = await services(request).keys.authenticate(secret.strip() if scheme.lower() == "bearer" else None)
            return await handler(request, user)
        except SignalError as error:
            status = http_status(error)
            if status == INTERNAL_STATUS:
                log.exception("download error", exc_info=error)
            return Response(error.message if status != INTERNAL_STATUS else "internal error", status_code=status,
                            media_type="text/plain",
                            headers={"X-Signal-Error-Code": error.code, **retry_after_headers(error)})

    return endpoint


def hx_redirect(request: Request, url: str) -> Response:
    """After an htmx action, send the browser to `url` (a plain redirect for non-htmx callers)."""
    if is_htmx(request):
        return Response(status_code=204, headers={"HX-Redirect": url})
    return RedirectResponse(url, status_code=303)
