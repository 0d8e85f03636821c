"""One-time dashboard sign-in links, as Jupyter prints at start: single use, short-lived, stored hashed.

`signal login-link` mints them in another process, so they live in the database, and consuming one is a
single conditional UPDATE: two tabs racing on the same link cannot both sign in.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from sqlalchemy import select, update

from app.db import Database
from app.errors import Unauthenticated
from app.tables import LoginLink, User, utcnow


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class LoginLinkService:
    def __init__(self, db: Database, ttl_s: int = 900) -> None:
        self.db = db
        self.ttl = timedelta(seconds=ttl_s)

    async def mint(self, user: User) -> str:
        """A new token for `user`; only its hash is kept, so it is shown this once."""
        token = secrets.token_urlsafe(32)
        now = utcnow()
        async with self.db.session() as session:
            session.add(LoginLink(token_hash=_hash(token), user_id=user.id, created_at=now, expires_at=now + self.ttl))
        return token

    async def usable(self, token: str) -> bool:
        """Whether `token` would sign in now (unused, unexpired, known); reads only, so a link previewer burns nothing."""
        async with self.db.session() as session:
            found = await session.scalar(
                select(LoginLink.token_hash)
                .where(LoginLink.token_hash == _hash(token or ""), LoginLink.used_at.is_(None),
                       LoginLink.expires_at > utcnow()))
        return found is not None

    async def consume(self, token: str) -> User:
        """The link's user, marking it used; refuses a used, expired or unknown token alike."""
        now = utcnow()
        async with self.db.session() as session:
            user_id = await session.scalar(
                update(LoginLink)
                .where(LoginLink.token_hash == _hash(token or ""), LoginLink.used_at.is_(None),
                       LoginLink.expires_at > now)
                .values(used_at=now)
                .returning(LoginLink.user_id)
            )
            user = await session.get(User, user_id) if user_id else None
        if user is None or user.disabled:
            raise Unauthenticated("this sign-in link is used, expired or unknown; `make login-link` (or `signal login-link`) mints a new one")
        return user
