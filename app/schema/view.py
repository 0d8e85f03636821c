"""The strawberry ASGI view: builds each request's context, authenticates websocket connections, and answers
every malformed request in GraphQL's error shape (400) before anyone is authenticated."""

from __future__ import annotations

import json
import re
from typing import Any

from cross_web import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket
from strawberry.asgi import GraphQL
from strawberry.exceptions import ConnectionRejectionError

from app.errors import BadInput, InvalidDocument, Unauthenticated
from app.schema.context import Context, Credential
from app.security import bearer_from_connection_params, bearer_from_header
from app.services import services_of

# What strawberry's own HTTP refusals (plain text) become: a code a client can branch on.
HTTP_CODES = {400: BadInput.code, 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}
# A JSON \\uD800-\\uDFFF escape: the only way a lone surrogate reaches us (form bodies replace invalid UTF-8).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class SignalGraphQL(GraphQL[Context, None]):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        try:
            response = await self.run(Request(scope=scope, receive=receive))
        except HTTPException as error:
            response = graphql_error(error.reason, HTTP_CODES.get(error.status_code, InvalidDocument.code),
                                     error.status_code)
        await response(scope, receive, send)

    def decode_json(self, data: str | bytes) -> object:
        """A GraphQL request object, or a 400 that says why not: strawberry catches only JSONDecodeError, so a body
        of `42`, invalid UTF-8 or arrays nested 5,000 deep would otherwise be a 500."""
        try:
            body = json.loads(data)
        except UnicodeDecodeError:
            raise HTTPException(400, "the request body is not valid UTF-8") from None
        except RecursionError:
            raise HTTPException(400, "the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise HTTPException(400, "the request body must be a JSON object with `query` (and `variables`), "
                                     f"got {type(body).__name__}")
        raw = data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")
        if SURROGATE_ESCAPE.search(raw):  # cheap on the bytes; the walk runs only when an escape is there
            where = _lone_surrogate(body.get("variables"), "variables")
            if where is not None:
                raise HTTPException(400, f"{where} has a character that is not valid Unicode text (a lone surrogate)")
        return body

    async def get_context(self, request: Request | WebSocket, response: Response | WebSocket) -> Context:
        services = services_of(request)
        return Context(services=services, credential=Credential(bearer_from_header(request.headers.get("authorization"))),
                       request=request, response=response)

    async def on_ws_connect(self, context: Context) -> Any:
        # The key may come in connectionParams or, for non-browser clients, the upgrade request's header.
        bearer = bearer_from_connection_params(context.connection_params)
        if bearer is not None:
            context.credential = Credential(bearer)
        try:
            await context.user()
        except Unauthenticated as error:
            raise ConnectionRejectionError({"code": error.code, "message": error.message}) from error
        return None


def graphql_error(message: str, code: str, status: int, field: str | None = None) -> JSONResponse:
    extensions = {"code": code, "retryable": False} | ({"field": field} if field else {})
    return JSONResponse({"errors": [{"message": message, "extensions": extensions}]}, status_code=status)


def _lone_surrogate(value: Any, where: str) -> str | None:
    """The path of the first string holding a lone surrogate, e.g. `variables.p[0]`."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(item, dict):
            stack.extend((v, f"{path}.{k}") for k, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None
