"""The reading pages: home, models and getting started."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from web.render import page, services, signed_in
from web.sdk import sdk_install_command
from web.session import current

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.tables import User


async def home(request: Request) -> Response:
    return RedirectResponse("/runs" if await current(request) is not None else "/login", status_code=303)


@signed_in
async def models_page(request: Request, user: User) -> Response:
    svc = services(request)
    return page(request, "models.html", user=user, models=svc.catalog.list(), default_model=svc.settings.default_model)


@signed_in
async def start_page(request: Request, user: User) -> Response:
    svc = services(request)
    keys = [key for key in await svc.keys.list(user) if key.revoked_at is None]
    return page(request, "start.html", user=user, key_prefix=keys[0].prefix if keys else None,
                default_model=svc.settings.default_model, install=sdk_install_command(request))


@signed_in
async def start_key(request: Request, user: User) -> Response:
    """A key made from Getting started: step 1's card again, its snippet holding the whole secret (shown once)."""
    svc = services(request)
    secret, key = await svc.keys.create(user, "getting-started")
    return page(request, "_start_env.html", user=user, secret=secret, key=key, install=sdk_install_command(request))


routes = [
    Route("/", home),
    Route("/models", models_page),
    Route("/start", start_page),
    Route("/start/key", start_key, methods=["POST"]),
]
