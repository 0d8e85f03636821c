"""One 413 per wire, before anything parses the body: a declared Content-Length over SIGNAL_MAX_REQUEST_BYTES is
answered here in the shape of the wire its path belongs to (Starlette's own limit would answer it as plain text); a
body that grows past the limit unannounced is met by Starlette's limit and answered by each wire the same way."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

TooLarge = Callable[[int], Response]  # the limit → the wire's 413


class BodyLimit:
    """Pure ASGI, outside Starlette's body limit: `shapes` maps a path prefix to its wire's 413; `default` is the
    rest's (GraphQL's and the dashboard's)."""

    def __init__(self, app: ASGIApp, max_bytes: int, shapes: Sequence[tuple[str, TooLarge]], default: TooLarge) -> None:
        self.app, self.max_bytes, self.shapes, self.default = app, max_bytes, shapes, default

    def shape(self, path: str) -> TooLarge:
        return next((shape for prefix, shape in self.shapes if path.startswith(prefix)), self.default)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            declared = dict(scope.get("headers") or []).get(b"content-length", b"")
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self.shape(scope["path"])(self.max_bytes)(scope, receive, send)
                return
        await self.app(scope, receive, send)
