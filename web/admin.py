"""The admin page (issue 18 §7): users (disable, enable), live API keys across users (revoke), runs across users and
the runtime's report. Everything comes from AdminService, which checks the admin; to anyone else every path here is a
404, as an unknown page is."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.errors import Forbidden, NotFound
from web.render import Handler, page, services, signed_in

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.tables import User


def admins_only(handler: Handler) -> Handler:
    """The page's existence is not for everyone to learn: the service's Forbidden becomes the 404 page."""

    @functools.wraps(handler)
    async def endpoint(request: Request, user: User) -> Response:
        try:
            return await handler(request, user)
        except Forbidden:
            raise NotFound("There is no page at this address.") from None

    return endpoint


@signed_in
@admins_only
async def admin_page(request: Request, user: User) -> Response:
    return page(request, "admin.html", user=user, view=await services(request).admin.view(user))


@signed_in
@admins_only
async def revoke_key(request: Request, user: User) -> Response:
    await services(request).admin.revoke_key(user, str(request.path_params["key_id"]))
    return await _people(request, user)


@signed_in
@admins_only
async def set_disabled(request: Request, user: User) -> Response:
    """disabled=1 disables (their sessions end at once, their keys stop); disabled=0 enables again."""
    form = await request.form()
    disabled = str(form.get("disabled", "1")) != "0"
    await services(request).admin.set_disabled(user, str(request.path_params["user_id"]), disabled)
    return await _people(request, user)


async def _people(request: Request, user: User) -> Response:
    # The users table and the keys table change together (a key's count, a user's status): one partial for both.
    return page(request, "_admin_people.html", user=user, view=await services(request).admin.view(user, with_runtime=False))


routes = [
    Route("/admin", admin_page),
    Route("/admin/keys/{key_id}", revoke_key, methods=["DELETE"]),
    Route("/admin/users/{user_id}/disabled", set_disabled, methods=["POST"]),
]
