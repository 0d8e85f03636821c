"""The Account page: the user's signed-in browsers (device, last seen, this one marked), and signing them out."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.services.sessions import session_hash
from web.render import hx_redirect, page, services, signed_in
from web.session import session_id, sign_out

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.tables import User

# First match wins: Edge and Opera say "Chrome" too, Chrome says "Safari" too.
BROWSERS = (("Edg/", "Edge"), ("OPR/", "Opera"), ("Firefox/", "Firefox"), ("Chrome/", "Chrome"),
            ("Chromium/", "Chromium"), ("Safari/", "Safari"), ("curl/", "curl"), ("python-httpx/", "httpx"))
SYSTEMS = (("Android", "Android"), ("iPhone", "iOS"), ("iPad", "iPadOS"), ("Windows", "Windows"),
           ("Mac OS X", "macOS"), ("CrOS", "ChromeOS"), ("Linux", "Linux"))


def device(user_agent: str) -> str:
    """"Chrome on Linux" from a User-Agent: enough to tell one's browsers apart."""
    browser = next((name for mark, name in BROWSERS if mark in user_agent), "")
    system = next((name for mark, name in SYSTEMS if mark in user_agent), "")
    if "HeadlessChrome/" in user_agent:
        browser = "Headless Chrome"
    if browser and system:
        return f"{browser} on {system}"
    return browser or system or (re.split(r"[\s/]", user_agent.strip(), maxsplit=1)[0] or "Unknown device")


@signed_in
async def account_page(request: Request, user: User) -> Response:
    return await _page(request, user, "account.html")


async def _page(request: Request, user: User, name: str) -> Response:
    rows = await services(request).sessions.list(user)
    mine = session_hash(session_id(request) or "")
    listed = [{"row": row, "device": device(row.user_agent), "current": row.id_hash == mine} for row in rows]
    ttl_days = max(1, services(request).settings.session_ttl_s // 86400)
    return page(request, name, user=user, sessions=listed, ttl_days=ttl_days)


@signed_in
async def sign_out_one(request: Request, user: User) -> Response:
    id_hash = str(request.path_params["id_hash"])
    if id_hash == session_hash(session_id(request) or ""):
        await sign_out(request)
        return hx_redirect(request, "/login")
    await services(request).sessions.revoke_listed(user, id_hash)
    return await _page(request, user, "_sessions_table.html")


@signed_in
async def sign_out_everywhere(request: Request, user: User) -> Response:
    await services(request).sessions.revoke_all(user)
    request.session.clear()
    return hx_redirect(request, "/login")


routes = [
    Route("/account", account_page, methods=["GET"]),
    Route("/account/sessions/{id_hash}", sign_out_one, methods=["DELETE"]),
    Route("/account/sign-out-everywhere", sign_out_everywhere, methods=["POST"]),
]
