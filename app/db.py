"""The database handle: one async engine and session factory, and migrations applied through Alembic.

Alembic is imported only when the database is behind: `at_head` compares its `alembic_version` rows with the
head revision read from the migration files' text, so an up-to-date start pays no Alembic import (0.2-0.4 s).
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError, InterfaceError
from sqlalchemy.exc import TimeoutError as SQLAlchemyTimeout
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.pool import NullPool

from app.errors import ResourceExhausted, SignalError, Unavailable
from app.resources import resource_dir
from app.settings import DB_LOCK_TIMEOUT_S, DB_STATEMENT_TIMEOUT_S

if TYPE_CHECKING:
    from alembic.config import Config

# `revision = '0007'` and `down_revision = '0006'` (or None, or a tuple when branches merge), as Alembic writes them.
_REVISION_LINE = re.compile(r"^(revision|down_revision)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.MULTILINE)


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class Database:
    def __init__(self, url: str, lock_timeout_s: float = DB_LOCK_TIMEOUT_S,
                 statement_timeout_s: float = DB_STATEMENT_TIMEOUT_S) -> None:
        self.url = url
        connect_args: dict[str, object] = {}  # the driver's: SQLite's lock timeout, asyncpg's server settings
        if url.startswith("sqlite"):
            connect_args["timeout"] = lock_timeout_s
        elif "+asyncpg" in url:
            connect_args["server_settings"] = {"lock_timeout": str(int(lock_timeout_s * 1000)),
                                               "statement_timeout": str(int(statement_timeout_s * 1000))}
        # JSON as text with its characters, not \u escapes: the runs list searches tags in that text ("café").
        self.engine: AsyncEngine = create_async_engine(url, connect_args=connect_args, json_serializer=_json_text)
        if url.startswith("sqlite"):
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        async with self._sessions() as session, session.begin():
            yield session

    async def dispose(self) -> None:
        await self.engine.dispose()


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]  # a DBAPI connection: no type to name
    cursor = dbapi_connection.cursor()
    # WAL lets the dashboard read while a run writes; foreign keys make ON DELETE CASCADE real.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def head_revisions(versions: Path | None = None) -> frozenset[str]:
    """The head revision(s) of the migration files, read as text: no Alembic import."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in (versions or resource_dir("migrations") / "versions").glob("*.py"):
        found = dict(_REVISION_LINE.findall(path.read_text()))
        if "revision" not in found:
            continue
        revisions.add(ast.literal_eval(found["revision"]))
        down = ast.literal_eval(found.get("down_revision", "None"))
        parents.update((down,) if isinstance(down, str) else down or ())
    return frozenset(revisions - parents)


async def database_revisions(url: str) -> frozenset[str]:
    """The revisions the database is at (empty for a new database, or one Alembic never ran on)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and not (parsed.database and Path(parsed.database).exists()):
        return frozenset()  # asking would create the file; a file that is not there is at no revision
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            rows = await connection.execute(text("SELECT version_num FROM alembic_version"))
            return frozenset(row[0] for row in rows)
    except DBAPIError:  # no alembic_version table yet
        return frozenset()
    finally:
        await engine.dispose()


async def at_head(url: str) -> bool:
    return await database_revisions(url) == head_revisions()


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    # No alembic.ini: the URL always comes from Signal's settings, so there is one source of truth.
    config = Config()
    config.set_main_option("script_location", str(resource_dir("migrations")))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(url: str) -> None:
    """Apply every migration (blocking; call before the event loop or in a thread)."""
    from alembic import command

    with _unsynced_sqlite_commits(url):
        command.upgrade(alembic_config(url), "head")


async def migrate_async(url: str) -> bool:
    """Bring the database to the head revision; returns whether anything had to be applied."""
    if await at_head(url):
        return False
    await asyncio.to_thread(migrate, url)
    return True


@contextmanager
def _unsynced_sqlite_commits(url: str) -> Iterator[None]:
    """While migrating a SQLite file: WAL with synchronous=NORMAL, so the migrations' ~40 DDL commits (Python's
    sqlite3 commits each DDL statement) do not fsync one by one (0.3 s on a fresh start). WAL stays consistent
    on power loss; at worst the last steps are undone and run again at the next start."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        yield
        return
    target = Path(parsed.database).resolve()

    def pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA database_list")
            # Engines of other databases in this process (tests serve several) connect meanwhile: leave them be.
            if any(row[1] == "main" and row[2] and Path(row[2]).resolve() == target for row in cursor.fetchall()):
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute("PRAGMA synchronous=NORMAL")
        finally:
            cursor.close()

    # Alembic's env.py makes its own engine: a listener on every engine, for the migration's duration only.
    event.listen(Engine, "connect", pragmas)
    try:
        yield
    finally:
        event.remove(Engine, "connect", pragmas)


# SQLSTATEs (PostgreSQL) and SQLite messages that mean "the database cannot take this now", not "the call is wrong".
_PG_UNAVAILABLE = {"55P03": "locked", "25006": "read-only", "57014": "too slow (statement_timeout)",
                   "57P01": "shutting down", "57P03": "starting up"}
_PG_FULL = {"53100", "53200"}  # disk_full, out_of_memory
_SQLITE_UNAVAILABLE = {"database is locked": "locked", "database table is locked": "locked",
                       "attempt to write a readonly database": "read-only", "unable to open database": "unreachable",
                       "disk i/o error": "failing"}


def database_error(exc: BaseException) -> SignalError | None:
    """What a database failure means to the caller: UNAVAILABLE (locked, read-only, unreachable: retried with the same
    request id), RESOURCE_EXHAUSTED (its disk is full), or None (not the database's; a bug, INTERNAL)."""
    if isinstance(exc, OSError) and not isinstance(exc, DBAPIError):
        return Unavailable("the database cannot be reached; try again shortly") if _is_connection(exc) else None
    if not isinstance(exc, (DBAPIError, SQLAlchemyTimeout)):
        return None
    if isinstance(exc, SQLAlchemyTimeout):
        return Unavailable("the database's connections are all busy; try again shortly")
    original = exc.orig
    state = getattr(original, "sqlstate", None) or getattr(original, "pgcode", None)
    if state in _PG_FULL:
        return ResourceExhausted("the server's database disk is full; nothing was written", resource="disk")
    if state in _PG_UNAVAILABLE:
        return Unavailable(f"the database is {_PG_UNAVAILABLE[state]}; try again shortly")
    message = str(original).lower()
    if "database or disk is full" in message:
        return ResourceExhausted("the server's database disk is full; nothing was written", resource="disk")
    for fragment, why in _SQLITE_UNAVAILABLE.items():
        if fragment in message:
            return Unavailable(f"the database is {why}; try again shortly")
    if exc.connection_invalidated or isinstance(exc, InterfaceError) or _is_connection(original):
        return Unavailable("the database cannot be reached; try again shortly")
    return None


def _is_connection(exc: BaseException | None) -> bool:
    return isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__name__ in {
        "ConnectionDoesNotExistError", "CannotConnectNowError", "InterfaceError", "ConnectionFailureError"}
