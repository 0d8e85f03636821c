"""The dashboard's route table and middleware, mounted by `app.server.create_app`."""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.routing import BaseRoute, Mount
from starlette.staticfiles import StaticFiles

from app.settings import Settings
from web import account, admin, auth, compare, keys, pages, playground, playground_stream, runs, sdk, usage
from web.csrf import CSRFMiddleware
from web.paths import STATIC
from web.security_headers import SecurityHeaders
from web.session import session_middleware


def routes() -> list[BaseRoute]:
    # compare before runs: /runs/compare is not a run id.
    return [*pages.routes, *auth.routes, *keys.routes, *compare.routes, *runs.routes, *playground.routes,
            *playground_stream.routes, *account.routes, *usage.routes, *admin.routes, *sdk.routes,
            Mount("/static", StaticFiles(directory=str(STATIC)), name="static")]


def middleware(settings: Settings) -> list[Middleware]:
    # Order matters: the headers wrap every answer (a CSRF refusal too); the session is decoded before the CSRF check
    # reads its token.
    return [Middleware(SecurityHeaders), session_middleware(settings), Middleware(CSRFMiddleware)]
