"""Users: looked up by email, created on first sight (CLI, first start, sign-in)."""

from __future__ import annotations

from sqlalchemy import func, select

from app.db import Database
from app.tables import User


class UserService:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def get_or_create(self, email: str, name: str = "", is_admin: bool = False) -> tuple[User, bool]:
        email = email.strip().lower()
        async with self.db.session() as session:
            user = await session.scalar(select(User).where(User.email == email))
            if user is not None:
                return user, False
            user = User(email=email, name=name or email.split("@")[0], is_admin=is_admin)
            session.add(user)
        return user, True

    async def get(self, user_id: str) -> User | None:
        async with self.db.session() as session:
            return await session.get(User, user_id)

    async def count(self) -> int:
        async with self.db.session() as session:
            return int(await session.scalar(select(func.count()).select_from(User)) or 0)
