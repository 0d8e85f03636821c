"""The strawberry ASGI view: builds each request's context and authenticates websocket connections."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket
from strawberry.asgi import GraphQL
from strawberry.exceptions import ConnectionRejectionError

from app.errors import Unauthenticated
from app.schema.context import Context, bearer_from_connection_params, bearer_from_header


class SignalGraphQL(GraphQL[Context, None]):
    async def get_context(self, request: Request | WebSocket, response: Response | WebSocket) -> Context:
        services = request.app.state.services
        return Context(services=services, bearer=bearer_from_header(request.headers.get("authorization")),
                       request=request, response=response)

    async def on_ws_connect(self, context: Context) -> Any:
        # The key may come in connectionParams or, for non-browser clients, the upgrade request's header.
        context.bearer = bearer_from_connection_params(context.connection_params) or context.bearer
        try:
            await context.user()
        except Unauthenticated as error:
            raise ConnectionRejectionError({"code": error.code, "message": error.message}) from error
        return None
