"""First start, once among many server processes: migrations and the admin's bootstrap, under one lock.

`uvicorn app.server:create_app --factory --workers N` starts N processes at once; each runs this, and the
lock makes the others wait for the first and then find nothing to do. On PostgreSQL the lock is a session
advisory lock (pg_advisory_lock, released if the holder dies); on SQLite, an flock beside the data.
"""

from __future__ import annotations

import asyncio
import fcntl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from app.db import Database, migrate_async
from app.services.keys import KeyService
from app.services.users import UserService
from app.settings import Settings

ADMIN_EMAIL = "admin@localhost"
STARTUP_LOCK_KEY = 0x5167_6E61_6C00  # pg_advisory_lock's bigint for Signal's start-up ("Signal" in hex, roughly)


@asynccontextmanager
async def startup_lock(settings: Settings) -> AsyncIterator[None]:
    """Held while one process migrates and bootstraps; the others block here until it is done."""
    url = settings.resolved_database_url
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if url.startswith("postgresql"):
        engine = create_async_engine(url, poolclass=NullPool)  # its own connection: the lock is that session's
        try:
            async with engine.connect() as connection:
                await connection.execute(select(func.pg_advisory_lock(STARTUP_LOCK_KEY)))
                try:
                    yield
                finally:
                    await connection.execute(select(func.pg_advisory_unlock(STARTUP_LOCK_KEY)))
        finally:
            await engine.dispose()
    else:
        with open(settings.data_dir / "startup.lock", "a") as handle:
            await asyncio.to_thread(fcntl.flock, handle, fcntl.LOCK_EX)
            yield  # closing the file releases it


async def first_start(settings: Settings) -> str | None:
    """Apply migrations (when the database is behind) and, with bootstrap_admin on an empty database, create the
    admin and a key: returns the key's secret (to print once), or None when there was nothing to create."""
    async with startup_lock(settings):
        await migrate_async(settings.resolved_database_url)
        return await bootstrap_admin(settings) if settings.bootstrap_admin else None


async def bootstrap_admin(settings: Settings) -> str | None:
    """On first start (no users yet) create the admin and a key, so a newcomer can train at once."""
    db = Database(settings.resolved_database_url)
    try:
        users = UserService(db)
        if await users.count():
            return None
        admin, _ = await users.get_or_create(ADMIN_EMAIL, name="admin", is_admin=True)
        secret, _ = await KeyService(db).create(admin, "first start")
        return secret
    finally:
        await db.dispose()


def login_url(base_url: str, token: str) -> str:
    return f"{base_url}/auth/link?token={token}"


def admin_key_notice(secret: str) -> str:
    return (f"Created a local admin user and its API key (shown this once):\n\n    SIGNAL_API_KEY={secret}\n"
            f"    TINKER_API_KEY=tml-{secret}   (the same key, for Tinker's SDK: docs/TINKER.md)\n")
