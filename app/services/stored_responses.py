"""/v1/responses' stored responses (issue 35), in the database: `previous_response_id` continues a conversation after
a restart and on any server process. A response is its user's alone (another user's is not found, like an unknown
one), kept for `openai_responses_ttl_s`, at most RESPONSES_PER_USER per user (the oldest goes first), and deleted with
its run (the foreign key's cascade): a conversation on a deleted run cannot be continued."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import delete, select

from app.db import Database
from app.tables import StoredResponse, User, utcnow
from gpu_runtime.contract.json_types import JSONObject, as_json_object

RESPONSES_PER_USER = 256  # stored conversations a user keeps; the oldest goes first
ID_LENGTH = 64  # the column's: resp_ and 32 hex digits fit


class StoredResponses:
    def __init__(self, db: Database, ttl_s: float) -> None:
        self.db = db
        self.ttl = timedelta(seconds=ttl_s)

    async def keep(self, user: User, ident: str, run_id: str | None, messages: list[JSONObject]) -> None:
        """Store the conversation `messages` (its answer, with its token ids, included; instructions not) under
        `ident`; the user's expired rows, and the oldest past the bound, go."""
        now = utcnow()
        async with self.db.session() as session:
            await session.execute(delete(StoredResponse).where(StoredResponse.user_id == user.id,
                                                               StoredResponse.expires_at < now))
            session.add(StoredResponse(id=ident, user_id=user.id, run_id=run_id, messages=messages, created_at=now,
                                       expires_at=now + self.ttl))
            await session.flush()
            newest = select(StoredResponse.id).where(StoredResponse.user_id == user.id).order_by(
                StoredResponse.created_at.desc(), StoredResponse.id.desc()).limit(RESPONSES_PER_USER)
            await session.execute(delete(StoredResponse).where(StoredResponse.user_id == user.id,
                                                               StoredResponse.id.not_in(newest.scalar_subquery())))

    async def get(self, user: User, ident: str) -> list[JSONObject] | None:
        """The messages of the user's unexpired response `ident`, else None (unknown, expired, another user's, or its
        run deleted)."""
        if not 0 < len(ident) <= ID_LENGTH or not ident.isprintable():  # no such row, never a query (NUL: PostgreSQL)
            return None
        async with self.db.session() as session:
            messages = await session.scalar(select(StoredResponse.messages).where(
                StoredResponse.id == ident, StoredResponse.user_id == user.id, StoredResponse.expires_at > utcnow()))
        return None if messages is None else [as_json_object(m, "messages") for m in messages]
