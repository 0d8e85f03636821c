"""The Starlette application: GraphQL at /graphql, /healthz, and the services' lifespan."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route, WebSocketRoute

from app.backends import Backend
from app.body_limit import BodyLimit
from app.db import migrate_async
from app.schema import schema
from app.schema.view import SignalGraphQL
from app.services import Services
from app.settings import Settings

log = logging.getLogger("signal.server")


def create_app(settings: Settings | None = None, backend: Backend | None = None) -> Starlette:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        await migrate_async(settings.resolved_database_url)
        services = Services.build(settings, backend)
        app.state.services = services
        app.state.started_at = time.time()
        await services.backend.start()
        try:
            yield
        finally:
            await services.close()

    graphql_app = SignalGraphQL(schema, keep_alive=True, keep_alive_interval=15,
                                connection_init_wait_timeout=timedelta(seconds=30))
    routes = [
        Route("/", home),
        Route("/healthz", healthz),
        Route("/graphql", graphql_app, methods=["GET", "POST"]),
        WebSocketRoute("/graphql", graphql_app),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(BodyLimit, max_bytes=settings.max_request_bytes)])
    app.state.settings = settings
    return app


async def healthz(request: Request) -> JSONResponse:
    # Answers from memory only: it must stay prompt while a run trains.
    return JSONResponse({"status": "ok", "uptime_s": round(time.time() - request.app.state.started_at, 3)})


async def home(request: Request) -> HTMLResponse:
    return HTMLResponse(
        "<!doctype html><title>Signal</title><h1>Signal</h1>"
        "<p>LoRA fine-tuning API. GraphQL and GraphiQL: <a href='/graphql'>/graphql</a>.</p>"
    )
