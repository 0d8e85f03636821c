"""Refuses any state-changing dashboard request without the session's CSRF token (header X-CSRF-Token).

A middleware rather than a per-handler check, so a new route cannot forget it. /graphql and /v1/ are exempt:
they authenticate with a bearer API key, never the cookie, so a forged cross-site request carries no credentials.
"""

from __future__ import annotations

from starlette.requests import HTTPConnection
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from web.session import csrf_ok

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
EXEMPT_PREFIXES = ("/graphql", "/v1/")  # both authenticate by API key only, never the cookie


class CSRFMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] not in SAFE_METHODS
                and not scope["path"].startswith(EXEMPT_PREFIXES) and not csrf_ok(HTTPConnection(scope))):
            response = PlainTextResponse("The form's security token is missing or stale; reload the page and try again.",
                                         status_code=403)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
