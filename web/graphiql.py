"""GraphiQL served from our own static files, so /graphql works on a machine without internet
(strawberry's page loads React and GraphiQL from a CDN)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from app.schema.view import SignalGraphQL
from web.render import templates


class DashboardGraphQL(SignalGraphQL):
    async def render_graphql_ide(self, request: Request) -> Response:
        return HTMLResponse(templates.get_template("graphiql.html").render())
