"""API keys: create (secret shown once), list, revoke, and authenticate a bearer secret."""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import select, update

from app.db import Database, database_error
from app.errors import BadInput, NotFound, Unauthenticated
from app.security import display_prefix, generate_api_key, hash_api_key
from app.services.users import require_admin
from app.tables import NAME_LENGTH, ApiKey, User, could_be_id, utcnow

# Writing last_used_at on every request would turn every read into a write.
LAST_USED_RESOLUTION = timedelta(minutes=1)
log = logging.getLogger("signal.keys")


class KeyService:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, user: User, name: str = "") -> tuple[str, ApiKey]:
        name = name.strip()
        if len(name) > NAME_LENGTH:
            raise BadInput(f"name must be at most {NAME_LENGTH} characters", field="name")
        secret = generate_api_key()
        key = ApiKey(user_id=user.id, name=name or "default", prefix=display_prefix(secret), key_hash=hash_api_key(secret))
        async with self.db.session() as session:
            session.add(key)
        return secret, key

    async def list(self, user: User) -> list[ApiKey]:
        async with self.db.session() as session:
            rows = await session.scalars(
                select(ApiKey).where(ApiKey.user_id == user.id).order_by(ApiKey.created_at.desc())
            )
            return list(rows)

    async def revoke(self, user: User, key_id: str) -> ApiKey:
        return await self._revoke(key_id, owner=user.id)

    async def revoke_any(self, admin: User, key_id: str) -> ApiKey:
        """An admin revokes any user's key (the admin page)."""
        require_admin(admin, "revoke another user's API key")
        return await self._revoke(key_id, owner=None)

    async def _revoke(self, key_id: str, owner: str | None) -> ApiKey:
        async with self.db.session() as session:
            key = await session.get(ApiKey, key_id) if could_be_id(key_id) else None
            if key is None or (owner is not None and key.user_id != owner):
                raise NotFound(f"API key {key_id!r} not found", field="id")
            if key.revoked_at is None:
                key.revoked_at = utcnow()
            return key

    async def authenticate(self, secret: str | None) -> User:
        if not secret:
            raise Unauthenticated("missing API key: send `Authorization: Bearer sk-...`")
        async with self.db.session() as session:
            key = await session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_api_key(secret)))
            if key is None or key.revoked_at is not None:
                raise Unauthenticated("API key is invalid or revoked")
            user = await session.get(User, key.user_id)
            if user is None:
                raise Unauthenticated("API key is invalid or revoked")
            if user.disabled:
                raise Unauthenticated("this API key's user is disabled on this server")
            stale = key.last_used_at is None or utcnow() - key.last_used_at > LAST_USED_RESOLUTION
        if stale:
            await self._mark_used(key.id)
        return user

    async def _mark_used(self, key_id: str) -> None:
        """Bookkeeping in a transaction of its own: a locked or read-only database still serves reads."""
        try:
            async with self.db.session() as session:
                await session.execute(update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=utcnow()))
        except Exception as exc:
            if database_error(exc) is None:
                raise
            log.warning("could not record the key's last use: %s", database_error(exc))

