"""Dashboard sessions on the server: the cookie carries a random id, the `sessions` table its hash.

A row is written only at sign-in. A cookie whose row is unknown, revoked or expired (or whose user is disabled) is
signed out, so sign-out, "Sign out everywhere" and disabling a user take effect at once, a copied cookie included.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Update, select, update

from app.db import Database, database_error
from app.tables import USER_AGENT_LENGTH, DashboardSession, User, utcnow

# Writing last_seen_at on every request would turn every page view into a write.
LAST_SEEN_RESOLUTION = timedelta(minutes=1)
log = logging.getLogger("signal.sessions")


def session_hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def revoke_all_of(user_id: str, now: datetime) -> Update:
    """The statement that ends every live session of a user (sign out everywhere, a user disabled)."""
    return (update(DashboardSession)
            .where(DashboardSession.user_id == user_id, DashboardSession.revoked_at.is_(None))
            .values(revoked_at=now))


@dataclass(frozen=True)
class LiveSession:
    """A session that is signed in: its row and its user."""

    row: DashboardSession
    user: User


class SessionService:
    def __init__(self, db: Database, ttl_s: int) -> None:
        self.db = db
        self.ttl = timedelta(seconds=ttl_s)

    async def create(self, user: User, user_agent: str = "") -> str:
        """A new session for `user`; returns the id for the cookie (only its hash is stored)."""
        session_id = secrets.token_urlsafe(32)
        now = utcnow()
        async with self.db.session() as session:
            session.add(DashboardSession(id_hash=session_hash(session_id), user_id=user.id, created_at=now,
                                         last_seen_at=now, expires_at=now + self.ttl,
                                         user_agent=user_agent[:USER_AGENT_LENGTH]))
        return session_id

    async def live(self, session_id: str | None, touch: bool = True) -> LiveSession | None:
        """The session and its user while it is live, else None. With `touch`, a visit: last seen (at most once a
        minute) and the expiry slide forward. Event streams re-check without touching."""
        if not session_id or not isinstance(session_id, str):
            return None
        now = utcnow()
        async with self.db.session() as session:
            found = (await session.execute(
                select(DashboardSession, User).join(User, User.id == DashboardSession.user_id)
                .where(DashboardSession.id_hash == session_hash(session_id), DashboardSession.revoked_at.is_(None),
                       DashboardSession.expires_at > now, User.disabled.is_(False))
            )).first()
        if found is None:
            return None
        row, user = found
        if touch and now - row.last_seen_at >= LAST_SEEN_RESOLUTION:
            await self._touch(row.id_hash, now)
        return LiveSession(row=row, user=user)

    async def list(self, user: User) -> list[DashboardSession]:
        """The user's live sessions, most recently seen first."""
        async with self.db.session() as session:
            rows = await session.scalars(
                select(DashboardSession)
                .where(DashboardSession.user_id == user.id, DashboardSession.revoked_at.is_(None),
                       DashboardSession.expires_at > utcnow())
                .order_by(DashboardSession.last_seen_at.desc()))
            return list(rows)

    async def revoke(self, session_id: str | None) -> None:
        """Sign-out: this session's row ends (a copy of its cookie is signed out too)."""
        if not session_id or not isinstance(session_id, str):
            return
        async with self.db.session() as session:
            await session.execute(update(DashboardSession)
                                  .where(DashboardSession.id_hash == session_hash(session_id),
                                         DashboardSession.revoked_at.is_(None))
                                  .values(revoked_at=utcnow()))

    async def revoke_listed(self, user: User, id_hash: str) -> None:
        """Sign out one of `user`'s sessions from the Account page (by its row's hash; another user's is untouched)."""
        async with self.db.session() as session:
            await session.execute(update(DashboardSession)
                                  .where(DashboardSession.id_hash == id_hash, DashboardSession.user_id == user.id,
                                         DashboardSession.revoked_at.is_(None))
                                  .values(revoked_at=utcnow()))

    async def revoke_all(self, user: User) -> int:
        """Sign out everywhere: every live session of `user`; returns how many ended."""
        async with self.db.session() as session:
            result = await session.execute(revoke_all_of(user.id, utcnow()))
        return int(getattr(result, "rowcount", 0) or 0)

    async def _touch(self, id_hash: str, now: datetime) -> None:
        """Bookkeeping in a transaction of its own: a locked or read-only database still serves pages."""
        try:
            async with self.db.session() as session:
                await session.execute(update(DashboardSession).where(DashboardSession.id_hash == id_hash)
                                      .values(last_seen_at=now, expires_at=now + self.ttl))
        except Exception as exc:
            if database_error(exc) is None:
                raise
            log.warning("could not record the session's last visit: %s", database_error(exc))
