"""The dashboard's session: a signed cookie (HttpOnly, SameSite=Lax, Secure behind https) holding the
user id and the CSRF token, and the helpers that read them."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import HTTPConnection

from app.settings import Settings

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.tables import User

COOKIE = "signal_session"
MAX_AGE_S = 14 * 24 * 3600
CSRF_HEADER = "x-csrf-token"


def session_secret(settings: Settings) -> str:
    """SIGNAL_SESSION_SECRET, or one generated once into the data directory (mode 0600) and reused,
    so sessions survive restarts and every server process on this data directory agrees."""
    if settings.session_secret:
        return settings.session_secret
    path = Path(settings.data_dir) / "session_secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_urlsafe(48))
    return path.read_text().strip()


def session_middleware(settings: Settings) -> Middleware:
    return Middleware(SessionMiddleware, secret_key=session_secret(settings), session_cookie=COOKIE,
                      max_age=MAX_AGE_S, same_site="lax",
                      https_only=settings.resolved_public_url.startswith("https://"))


def csrf_token(conn: HTTPConnection) -> str:
    """The session's CSRF token, made on first use; every page puts it in htmx's hx-headers."""
    token = conn.session.get("csrf")
    if not token:
        token = conn.session["csrf"] = secrets.token_urlsafe(32)
    return str(token)


def csrf_ok(conn: HTTPConnection) -> bool:
    expected = conn.session.get("csrf") if "session" in conn.scope else None
    sent = conn.headers.get(CSRF_HEADER, "")
    return bool(expected) and hmac.compare_digest(str(expected), sent)


def sign_in(conn: HTTPConnection, user: User) -> None:
    # A fresh session on sign-in: nothing an attacker planted before (a CSRF token) survives it.
    conn.session.clear()
    conn.session["user_id"] = user.id
    csrf_token(conn)


def sign_out(conn: HTTPConnection) -> None:
    conn.session.clear()
