"""The dashboard's session: a signed cookie (HttpOnly, SameSite=Lax, Secure behind https) holding a random
session id, the CSRF token and what is kept before sign-in (Google's pending states, where to go after); the
signed-in state itself is the id's row on the server (app/services/sessions.py), so it can be revoked."""

from __future__ import annotations

import hmac
import secrets
from typing import TYPE_CHECKING

from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import HTTPConnection

from app.security import server_secret
from app.services import services_of
from app.settings import Settings

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.services.sessions import LiveSession
    from app.tables import User

COOKIE = "signal_session"
CSRF_HEADER = "x-csrf-token"
SESSION_ID = "sid"  # the cookie's key for the session id (cookies from before server-side sessions have none)


def session_secret(settings: Settings) -> str:
    """The server's signing secret (app/security.py): the cookie's, shared with Tinker's download links."""
    return server_secret(settings)


def session_middleware(settings: Settings) -> Middleware:
    return Middleware(SessionMiddleware, secret_key=session_secret(settings), session_cookie=COOKIE,
                      max_age=settings.session_ttl_s, same_site="lax",
                      https_only=settings.resolved_public_url.startswith("https://"))


def csrf_token(conn: HTTPConnection) -> str:
    """The session's CSRF token, made on first use; every page puts it in htmx's hx-headers."""
    token = conn.session.get("csrf")
    if not token:
        token = conn.session["csrf"] = secrets.token_urlsafe(32)
    return str(token)


def csrf_ok(conn: HTTPConnection) -> bool:
    """Whether the request's X-CSRF-Token header is this session's token."""
    return csrf_matches(conn, conn.headers.get(CSRF_HEADER, ""))


def csrf_matches(conn: HTTPConnection, sent: object) -> bool:
    expected = conn.session.get("csrf") if "session" in conn.scope else None
    return bool(expected) and isinstance(sent, str) and hmac.compare_digest(str(expected), sent)


def session_id(conn: HTTPConnection) -> str | None:
    value = conn.session.get(SESSION_ID) if "session" in conn.scope else None
    return value if isinstance(value, str) else None


async def current(conn: HTTPConnection, touch: bool = True) -> LiveSession | None:
    """The signed-in session of this request, or None (no cookie, or its row is revoked, expired or unknown)."""
    sid = session_id(conn)
    return await services_of(conn).sessions.live(sid, touch=touch) if sid else None


async def sign_in(conn: HTTPConnection, user: User) -> None:
    # A fresh session on sign-in: nothing an attacker planted before (a CSRF token, a session id) survives it,
    # and a session this browser held before ends rather than living on unseen.
    services = services_of(conn)
    await services.sessions.revoke(session_id(conn))
    conn.session.clear()
    agent = conn.headers.get("user-agent", "")
    conn.session[SESSION_ID] = await services.sessions.create(user, agent)
    csrf_token(conn)


async def sign_out(conn: HTTPConnection) -> None:
    await services_of(conn).sessions.revoke(session_id(conn))
    conn.session.clear()
