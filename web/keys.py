"""API keys page: create (secret shown once), list, revoke."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.errors import BadInput
from web.render import page, services, signed_in

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.tables import User


@signed_in
async def keys_page(request: Request, user: User) -> Response:
    return page(request, "keys.html", user=user, keys=await services(request).keys.list(user))


@signed_in
async def create_key(request: Request, user: User) -> Response:
    form = await request.form()
    name = str(form.get("name", "")).strip()
    if not name:  # the service's "default" is for programs; a person names a key to tell it apart later
        raise BadInput("Name the key (e.g. laptop or ci), so you can tell it apart when you revoke one.",
                       field="name")
    secret, key = await services(request).keys.create(user, name)
    # The new secret replaces the form's result slot; the table refreshes out of band.
    return page(request, "_key_created.html", user=user, secret=secret, key=key,
                keys=await services(request).keys.list(user))


@signed_in
async def revoke_key(request: Request, user: User) -> Response:
    await services(request).keys.revoke(user, request.path_params["key_id"])
    return page(request, "_keys_table.html", user=user, keys=await services(request).keys.list(user))


routes = [
    Route("/keys", keys_page, methods=["GET"]),
    Route("/keys", create_key, methods=["POST"]),
    Route("/keys/{key_id}", revoke_key, methods=["DELETE"]),
]
