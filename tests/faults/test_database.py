"""A locked or read-only database is UNAVAILABLE (retryable), never INTERNAL; the server answers again once the
lock is gone. SQLite stands for both here (CI runs as root, so chmod stops nothing: the read-only case opens the
file with SQLite's mode=ro); PostgreSQL's codes are mapped alike (app/db.py: database_error)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.db import database_error
from app.errors import ResourceExhausted, SignalError, Unavailable
from tests.conftest import ON_POSTGRES
from tests.helpers.live_server import LiveServer, settings_for

CREATE_KEY = {"query": 'mutation { createApiKey(name: "k") { secret } }'}
RUNS = {"query": "{ runs { id } }"}
# The lock and the read-only file are SQLite's; PostgreSQL's states are mapped by the same function (tested below).
sqlite_only = pytest.mark.skipif(ON_POSTGRES, reason="holds a SQLite lock and opens a SQLite file read-only")


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # A short lock wait, so the locked call answers in a second, not the default five.
    live = LiveServer.start(settings_for(tmp_path_factory.mktemp("db-faults"), tiny_model_dir, db_lock_timeout_s=0.5),
                            wait_for_runtime=False)
    yield live
    live.stop()


def post(server: LiveServer, key: str, body: dict[str, str]) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/graphql", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    return dict(response.json())


def sqlite_file(server: LiveServer) -> Path:
    return Path(server.settings.resolved_database_url.split("///", 1)[1])


@sqlite_only
def test_a_write_under_an_exclusive_lock_is_unavailable_then_succeeds(server: LiveServer) -> None:
    key = server.new_user()
    holder = sqlite3.connect(sqlite_file(server), isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        body = post(server, key, CREATE_KEY)
        (error,) = body["errors"]
        assert error["extensions"]["code"] == "UNAVAILABLE" and error["extensions"]["retryable"] is True
        assert "locked" in error["message"]
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    body = post(server, key, CREATE_KEY)
    assert "errors" not in body and body["data"]["createApiKey"]["secret"].startswith("sk-")


@sqlite_only
def test_a_read_only_database_is_unavailable_for_writes_and_serves_reads(server: LiveServer, tiny_model_dir: str,
                                                                          tmp_path: Path) -> None:
    key = server.new_user()  # made while the database is writable
    url = f"sqlite+aiosqlite:///file:{sqlite_file(server)}?mode=ro&uri=true"
    reader = LiveServer.start(settings_for(tmp_path / "ro", tiny_model_dir, database_url=url), wait_for_runtime=False)
    try:
        assert post(reader, key, RUNS)["data"] == {"runs": []}
        (error,) = post(reader, key, CREATE_KEY)["errors"]
        assert error["extensions"]["code"] == "UNAVAILABLE" and "read-only" in error["message"]
    finally:
        reader.stop()


class _PgError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(("sqlstate", "expected"), [
    ("55P03", Unavailable), ("25006", Unavailable), ("57014", Unavailable), ("53100", ResourceExhausted),
])
def test_postgres_states_are_classed(sqlstate: str, expected: type[SignalError]) -> None:
    """PostgreSQL's SQLSTATEs as asyncpg reports them (`.sqlstate` on the driver's exception)."""
    from sqlalchemy.exc import DBAPIError

    error = database_error(DBAPIError("statement", {}, _PgError(sqlstate)))
    assert isinstance(error, expected)
    assert error.retryable is (expected is Unavailable)
