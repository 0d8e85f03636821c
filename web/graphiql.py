"""/graphql for the dashboard: GraphiQL served from our own static files, so it works on a machine without internet
(strawberry's page loads React and GraphiQL from a CDN), and signed in with the dashboard's session.

A request without an Authorization header is the session's only when it carries the session's CSRF token (the
X-CSRF-Token header on a POST, `X-CSRF-Token` in a websocket's connectionParams): a cross-site page sends the
cookie but cannot read the token. A GET never uses the cookie. A pasted Authorization header always wins.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.websockets import WebSocket

from app.schema.context import Context, Credential
from app.schema.view import SignalGraphQL
from app.security import bearer_from_connection_params
from web.render import services, templates
from web.session import CSRF_HEADER, csrf_matches, csrf_ok, csrf_token, session_id

WS_CSRF_PARAMS = ("X-CSRF-Token", "x-csrf-token", "csrfToken")


class DashboardGraphQL(SignalGraphQL):
    async def render_graphql_ide(self, request: Request) -> Response:
        url = f"{services(request).settings.resolved_public_url}/graphql"
        return HTMLResponse(templates.get_template("graphiql.html").render(csrf=csrf_token(request),
                                                                            csrf_header=CSRF_HEADER, url=url))

    async def get_context(self, request: Request | WebSocket, response: Response | WebSocket) -> Context:
        context = await super().get_context(request, response)
        if (isinstance(request, Request) and request.method == "POST" and "authorization" not in request.headers
                and csrf_ok(request)):
            context.credential = Credential(session_id=session_id(request))
        return context

    async def on_ws_connect(self, context: Context) -> Any:
        params = context.connection_params if isinstance(context.connection_params, dict) else {}
        websocket = context.request
        if (isinstance(websocket, WebSocket) and bearer_from_connection_params(params) is None
                and "authorization" not in websocket.headers):
            sent = next((params[name] for name in WS_CSRF_PARAMS if name in params), None)
            if csrf_matches(websocket, sent):
                context.credential = Credential(session_id=session_id(websocket))
        # Strawberry checked the handshake's Origin before this (a cross-site page is refused there).
        return await super().on_ws_connect(context)
