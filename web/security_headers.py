"""Security headers on every answer, from a pure-ASGI middleware (a BaseHTTPMiddleware would buffer SSE streams and
downloads, and break Starlette's disconnect detection).

Pages may not be framed, sniffed or leak their URL to other sites; HTML gets a Content-Security-Policy that allows
our own files only (htmx's eval and injected styles are turned off in base.html's htmx-config). GraphiQL 3 injects
<style> elements at run time and its CSS uses data: fonts, so its page alone allows those.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; font-src 'self'; "
            "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
GRAPHIQL_CSP = PAGE_CSP.replace("style-src 'self'", "style-src 'self' 'unsafe-inline'").replace(
    "font-src 'self'", "font-src 'self' data:")
NO_REFERRER_PATHS = ("/auth/link",)  # its URL holds a one-time sign-in token


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.setdefault("X-Content-Type-Options", "nosniff")
                headers.setdefault("X-Frame-Options", "DENY")
                headers.setdefault("Referrer-Policy", "no-referrer" if path.startswith(NO_REFERRER_PATHS) else "same-origin")
                if headers.get("content-type", "").startswith("text/html"):
                    headers.setdefault("Content-Security-Policy", GRAPHIQL_CSP if path == "/graphql" else PAGE_CSP)
                    # Pages are per user (signed in, or a key just created): never kept by a browser or proxy.
                    headers.setdefault("Cache-Control", "no-store")
            await send(message)

        await self.app(scope, receive, send_with_headers)
