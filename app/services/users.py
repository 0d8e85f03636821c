"""Users: looked up by email, created on first sight (CLI, first start, sign-in)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from app.db import Database
from app.errors import BadInput, Forbidden, NotFound, Unauthenticated
from app.services.sessions import revoke_all_of
from app.tables import EMAIL_LENGTH, NAME_LENGTH, User, could_be_id, utcnow


def require_admin(user: User, action: str) -> None:
    """The one admin check of every front end: Forbidden, naming the action, unless `user` is an admin."""
    if not user.is_admin:
        raise Forbidden(f"only admins may {action}")


class UserService:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def get_or_create(self, email: str, name: str = "", is_admin: bool = False) -> tuple[User, bool]:
        email = email.strip().lower()
        if len(email) > EMAIL_LENGTH:
            raise BadInput(f"email must be at most {EMAIL_LENGTH} characters", field="email")
        existing = await self.find(email)
        if existing is not None:
            return existing, False
        try:
            async with self.db.session() as session:
                user = User(email=email, name=_display_name(name, email), is_admin=is_admin)
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

    async def sign_in_external(self, user_id: str, email: str, name: str = "", email_verified: bool = False,
                               make_admin: bool = False) -> User:
        """The Signal user for a Supabase sign-in (its user id is `user_id`).

        Known id: that user. Otherwise an existing user with the same email is linked only when Supabase has
        verified the address (Google's always are): whoever proves the email owns the account. Otherwise a new
        user whose id is the Supabase id. Emails in SIGNAL_ADMIN_EMAILS are made admins; nobody is demoted here.
        """
        email = email.strip().lower()
        async with self.db.session() as session:
            user = await session.get(User, user_id)
            if user is None and email:
                user = await session.scalar(select(User).where(User.email == email))
                if user is not None and not email_verified:
                    raise Unauthenticated(f"{email} belongs to an existing user; sign in with a verified email")
            if user is None:
                if not email:
                    raise Unauthenticated("the sign-in carried no email")
                user = User(id=user_id, email=email, name=_display_name(name, email), is_admin=make_admin)
                session.add(user)
            elif make_admin and not user.is_admin:
                user.is_admin = True
            if user.disabled:
                raise Unauthenticated(f"{user.email} is disabled on this server; ask an admin")
            return user

    async def set_disabled(self, actor: User, user_id: str, disabled: bool = True) -> User:
        """An admin disables (or enables) a user. Disabling ends every dashboard session of theirs at once; their API
        keys stop authenticating while disabled (KeyService.authenticate), and they cannot sign in."""
        require_admin(actor, "disable users")
        if disabled and user_id == actor.id:
            raise BadInput("an admin cannot disable themselves", field="id")
        async with self.db.session() as session:
            user = await session.get(User, user_id) if could_be_id(user_id) else None
            if user is None:
                raise NotFound(f"user {user_id!r} not found", field="id")
            user.disabled = disabled
            if disabled:
                await session.execute(revoke_all_of(user.id, utcnow()))
            return user


def _display_name(name: str, email: str) -> str:
    # An identity provider's full name can be any length; the column holds NAME_LENGTH (PostgreSQL enforces it).
    return (name.strip() or email.split("@")[0])[:NAME_LENGTH]
