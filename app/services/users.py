"""Users: looked up by email, created on first sight (CLI, first start, sign-in)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from app.db import Database
from app.tables import User


class UserService:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def get_or_create(self, email: str, name: str = "", is_admin: bool = False) -> tuple[User, bool]:
        email = email.strip().lower()
        existing = await self.find(email)
        if existing is not None:
            return existing, False
        try:
            async with self.db.session() as session:
                user = User(email=email, name=name or email.split("@")[0], is_admin=is_admin)
                session.add(user)
        except IntegrityError:
            # Created by a concurrent request between our look-up and insert: that one is ours too.
            found = await self.find(email)
            if found is None:
                raise
            return found, False
        return user, True

    async def find(self, email: str) -> User | None:
        async with self.db.session() as session:
            return await session.scalar(select(User).where(User.email == email.strip().lower()))

    async def get(self, user_id: str) -> User | None:
        async with self.db.session() as session:
            return await session.get(User, user_id)

    async def count(self) -> int:
        async with self.db.session() as session:
            return int(await session.scalar(select(func.count()).select_from(User)) or 0)
