"""The playground's one-time stream ids (issue 18 §4), in the database: the page's POST keeps the validated sample
under a random id (only its hash is stored) and its EventSource GET, served by any server process, opens it once.
An id is the user's alone (another user's is not found), opens within STREAM_TTL, and never twice; once opened, the
row stays until its stream ends so that a pane's Cancel, on any process, finds the runtime request id it names."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from sqlalchemy import and_, delete, or_, select, update

from app.db import Database
from app.errors import NotFound
from app.tables import Pane, PlaygroundStream, User, utcnow

STREAM_TTL = timedelta(minutes=10)  # an id not opened by then is refused: the page opens it at once
OPENED_KEEP = timedelta(days=1)  # an opened row its server never closed (the process died) is dropped after this
GONE = "This sample was started already, or has expired: press Sample again."


def stream_hash(ident: str) -> str:
    return hashlib.sha256(ident.encode()).hexdigest()


class PlaygroundStreams:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def keep(self, user: User, panes: list[Pane]) -> str:
        """A new one-time id for `panes` (JSON: each pane's model, sample and request id); stale rows go first."""
        ident = secrets.token_urlsafe(16)
        now = utcnow()
        async with self.db.session() as session:
            await session.execute(delete(PlaygroundStream).where(or_(
                and_(PlaygroundStream.opened_at.is_(None), PlaygroundStream.expires_at < now),
                PlaygroundStream.created_at < now - OPENED_KEEP)))
            session.add(PlaygroundStream(id_hash=stream_hash(ident), user_id=user.id, panes=panes, created_at=now,
                                         expires_at=now + STREAM_TTL))
        return ident

    async def open(self, user: User, ident: str) -> list[Pane]:
        """The panes kept under `ident`, once: one conditional UPDATE marks it opened, so of two GETs (on any two
        processes) one streams and the other is not found; so is an expired id, or another user's (left unopened)."""
        now = utcnow()
        async with self.db.session() as session:
            opened = await session.execute(update(PlaygroundStream).where(
                PlaygroundStream.id_hash == stream_hash(ident), PlaygroundStream.user_id == user.id,
                PlaygroundStream.opened_at.is_(None), PlaygroundStream.expires_at > now).values(opened_at=now))
            if getattr(opened, "rowcount", 0) != 1:
                raise NotFound(GONE)
            panes = await session.scalar(select(PlaygroundStream.panes)
                                         .where(PlaygroundStream.id_hash == stream_hash(ident)))
        return list(panes or [])

    async def streaming(self, user: User, ident: str) -> list[Pane]:
        """The panes of the user's stream `ident` while it streams (opened, not yet closed), for a pane's Cancel."""
        async with self.db.session() as session:
            panes = await session.scalar(select(PlaygroundStream.panes).where(
                PlaygroundStream.id_hash == stream_hash(ident), PlaygroundStream.user_id == user.id,
                PlaygroundStream.opened_at.is_not(None)))
        if panes is None:
            raise NotFound("This sample is not streaming: it ended, or has not started.")
        return list(panes)

    async def close(self, ident: str) -> None:
        """The stream ended (every pane answered, or the page went away): nothing is left to cancel."""
        async with self.db.session() as session:
            await session.execute(delete(PlaygroundStream).where(PlaygroundStream.id_hash == stream_hash(ident)))
