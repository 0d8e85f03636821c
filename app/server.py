"""The Starlette application: GraphQL at /graphql, /healthz, the dashboard (web/), and the services' lifespan."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as SQLAlchemyTimeout
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.types import ASGIApp

from app.backends import Backend, check_backend
from app.body_limit import BodyLimit
from app.errors import NotFound, PayloadTooLarge
from app.openai import openai_app
from app.openai.errors import too_large as openai_too_large
from app.schema import schema
from app.server_url import forget, record
from app.services import Services, services_of
from app.settings import Settings
from app.startup import ADMIN_EMAIL, admin_key_notice, first_start, login_url
from app.tinker import routes as tinker_routes
from app.tinker.endpoint import PREFIX as TINKER_PREFIX
from app.tinker.endpoint import too_large as tinker_too_large
from web import middleware as dashboard_middleware
from web import routes as dashboard_routes
from web.graphiql import DashboardGraphQL
from web.render import failure_page, not_found_page

log = logging.getLogger("signal.server")


def _show_signal_logs(level: str) -> None:
    """Signal's own log lines (loggers `signal.*`) on stderr at the server's log level, beside uvicorn's, which
    configures its loggers alone: else only warnings would show, through Python's last-resort handler. Left alone
    where the process already logs somewhere (a root handler: an embedding app, pytest)."""
    logger = logging.getLogger("signal")
    if logging.getLogger().handlers or logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)-9s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())


def create_app(settings: Settings | None = None, backend: Backend | None = None, announce: bool = False) -> Starlette:
    """The app; with `announce` (`signal serve`), its start prints the admin's sign-in link and the URL too."""
    settings = settings or Settings()
    _show_signal_logs(settings.log_level)
    if backend is None:
        check_backend(settings)  # e.g. SIGNAL_BACKEND=modal without credentials: said now, not at the first call

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Migrations and the admin's bootstrap: once among all the processes `uvicorn --workers N` starts.
        secret = await first_start(settings)
        if secret:
            print(admin_key_notice(secret), flush=True)
        services = Services.build(settings, backend)
        app.state.services = services
        app.state.started_at = time.time()
        await services.backend.start()
        await services.feed.start()
        services.tinker.start()  # Tinker futures' owner heartbeat and shared poll
        if services.billing is not None:
            services.billing.start()  # deductions a stopped (or crashed) server still owed are sent now
        record(settings.data_dir, settings.resolved_public_url)  # what `signal login-link` prints links to
        if announce:
            await _announce(services)
        try:
            yield
        finally:
            forget(settings.data_dir)
            await services.close()

    # DashboardGraphQL: SignalGraphQL with GraphiQL served from static/ (works offline).
    graphql_app = DashboardGraphQL(schema, keep_alive=True, keep_alive_interval=15,
                                   connection_init_wait_timeout=timedelta(seconds=30))
    routes = [
        Route("/healthz", healthz),
        Route("/graphql", graphql_app, methods=["GET", "POST"]),
        WebSocketRoute("/graphql", graphql_app),
        *tinker_routes(),  # /api/v1: Tinker's wire (docs/TINKER.md)
        Mount("/v1", app=openai_app()),  # OpenAI-compatible (docs/OPENAI.md)
        *dashboard_routes(),
    ]
    # Starlette refuses bodies over max_body_size with 413 before anything parses them.
    app = SignalApp(routes=routes, lifespan=lifespan, max_body_size=settings.max_request_bytes,
                    exception_handlers={404: not_found, 413: payload_too_large, **DATABASE_FAILURES}, middleware=dashboard_middleware(settings))
    app.state.settings = settings
    return app


# The database's failures that reach the app (the wires and GraphQL map their own): the dashboard's page or toast.
DATABASE_FAILURES: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    DBAPIError: failure_page, SQLAlchemyTimeout: failure_page}

# Each wire's 413, by path: OpenAI's shape on /v1, Tinker's on /api/v1, GraphQL's elsewhere.
TOO_LARGE: list[tuple[str, Callable[[int], Response]]] = [
    ("/v1/", lambda limit: openai_too_large(limit).response()), (TINKER_PREFIX + "/", tinker_too_large)]


def graphql_too_large(limit: int, detail: str = "Content Too Large") -> Response:
    # A GraphQL-shaped answer, so clients read the code as they read any other error.
    return JSONResponse({"errors": [{"message": f"{detail}: the request body is over {limit} bytes",
                                     "extensions": {"code": PayloadTooLarge.code}}]},
                        status_code=PayloadTooLarge.status)


class SignalApp(Starlette):
    """Starlette with declared-too-large bodies answered in each wire's shape, outside Starlette's body limit."""

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        if self.max_body_size is None:
            return stack
        return BodyLimit(stack, self.max_body_size, TOO_LARGE, graphql_too_large)


async def _announce(services: Services) -> None:
    settings = services.settings
    admin = None if settings.supabase_enabled else await services.users.find(ADMIN_EMAIL)
    if admin is not None:  # the admin's sign-in link, as Jupyter prints its token
        link = login_url(settings.resolved_public_url, await services.login_links.mint(admin))
        print(f"Dashboard sign-in link for {ADMIN_EMAIL} (works once, expires in {settings.login_link_ttl_s // 60} "
              f"min; `make login-link`, or `signal login-link` with .venv/bin on PATH, mints another):\n\n    {link}\n")
    print(f"Signal at {settings.resolved_public_url}  (GraphQL: {settings.resolved_public_url}/graphql)", flush=True)


UNHEALTHY = {"unresponsive", "down"}  # 503: a load balancer should route elsewhere


async def healthz(request: Request) -> JSONResponse:
    # Answers from memory only: it must stay prompt while a run trains, and while the runtime starts or hangs.
    status = services_of(request).backend.health
    return JSONResponse({"status": status, "uptime_s": round(time.time() - request.app.state.started_at, 3)},
                        status_code=503 if status in UNHEALTHY else 200)


# Paths that programs call: an unknown one is answered in JSON, never with the dashboard's page. /api/v1 and /v1
# answer their own unknown paths in their clients' shapes (app/tinker/routes.py, app/openai/routes.py).
API_PATHS = ("/api/", "/v1/", "/graphql/")


async def not_found(request: Request, exc: Exception) -> Response:
    path = request.url.path
    if path == "/api" or path.startswith(API_PATHS):
        return JSONResponse({"errors": [{"message": f"no API at {request.method} {path}",
                                         "extensions": {"code": NotFound.code}}]}, status_code=404)
    return await not_found_page(request, exc)


async def payload_too_large(request: Request, exc: Exception) -> Response:
    """A body that grew past the limit while it streamed in (no Content-Length), in its wire's shape."""
    limit = services_of(request).settings.max_request_bytes
    path = request.url.path
    shape = next((shape for prefix, shape in TOO_LARGE if path.startswith(prefix)), None)
    if shape is not None:
        return shape(limit)
    return graphql_too_large(limit, exc.detail if isinstance(exc, HTTPException) else "Content Too Large")
