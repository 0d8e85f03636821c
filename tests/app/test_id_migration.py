"""Migration 0003: every id becomes a dashed UUID (36 characters), rows written before it included, on SQLite and
on PostgreSQL; the runtime adopts a run directory written under a 32-hex id."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import MetaData, text
from sqlalchemy.ext.asyncio import create_async_engine

from app.db import alembic_config
from app.tables import new_id
from gpu_runtime.client.persistence import RunPaths, find_run_dir, read_json, write_json
from tests.helpers.postgres import Cluster

DASHED = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
NOW = datetime(2026, 12, 1, 10, tzinfo=UTC)
# Every column holding a user or run id, and the parent it points at.
ID_COLUMNS = {("users", "id"): None, ("api_keys", "id"): None, ("api_keys", "user_id"): ("users", "id"),
              ("login_links", "user_id"): ("users", "id"), ("runs", "id"): None, ("runs", "user_id"): ("users", "id"),
              ("metrics", "run_id"): ("runs", "id"), ("samples", "run_id"): ("runs", "id"),
              ("checkpoints", "run_id"): ("runs", "id")}


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'signal.db'}"
        return
    cluster: Cluster = request.getfixturevalue("postgres_cluster")
    name = cluster.create_database("id_migration")
    yield cluster.url(name)
    cluster.drop_database(name)


def test_migrations_have_one_head() -> None:
    assert len(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads()) == 1


def test_new_ids_are_dashed_uuids() -> None:
    assert DASHED.match(new_id()) and len(new_id()) == 36


def legacy_rows(users: int = 2) -> list[tuple[str, dict]]:
    """Rows as revision 0002 stored them: 32-hex ids, a checkpoint path naming runs/{user}/{run}."""
    rows: list[tuple[str, dict]] = []
    for n in range(users):
        user, key, run = (uuid.uuid4().hex for _ in range(3))
        rows += [
            ("users", {"id": user, "email": f"u{n}@example.com", "name": "", "is_admin": False, "created_at": NOW}),
            ("api_keys", {"id": key, "user_id": user, "name": "k", "prefix": "sk-x", "key_hash": uuid.uuid4().hex * 2,
                          "created_at": NOW}),
            ("login_links", {"token_hash": uuid.uuid4().hex * 2, "user_id": user, "created_at": NOW, "expires_at": NOW}),
            ("runs", {"id": run, "user_id": user, "base_model": "m", "lora_config": {}, "optimizer_config": {}, "seed": 0,
                      "gpu_config": "", "status": "active", "step": 1, "trainable_params": 1, "total_params": 2,
                      "created_at": NOW, "updated_at": NOW}),
            ("metrics", {"run_id": run, "step": 1, "name": "loss", "value": 1.5, "created_at": NOW}),
            ("samples", {"run_id": run, "step": 1, "prompt": "p", "output": "o", "params": {}, "created_at": NOW}),
            ("checkpoints", {"run_id": run, "step": 1, "mode": "state", "path": f"/data/runs/{user}/{run}/checkpoints/state_1",
                             "size_bytes": 10, "created_at": NOW}),
        ]
    return rows


async def test_upgrade_dashes_existing_ids_and_keeps_references(database_url: str) -> None:
    config = alembic_config(database_url)
    await asyncio.to_thread(command.upgrade, config, "0002")
    rows = legacy_rows()
    engine = create_async_engine(database_url)
    try:
        async with engine.begin() as conn:
            tables = MetaData()
            await conn.run_sync(tables.reflect)
            for table, row in rows:
                await conn.execute(tables.tables[table].insert(), row)
        await asyncio.to_thread(command.upgrade, config, "head")

        async with engine.connect() as conn:
            for (table, column), parent in ID_COLUMNS.items():
                values = (await conn.execute(text(f"SELECT {column} FROM {table}"))).scalars().all()
                assert len(values) == 2 and all(DASHED.match(v) for v in values), (table, column, values)
                if parent:  # every child still finds its parent
                    orphans = await conn.execute(text(f"SELECT count(*) FROM {table} c LEFT JOIN {parent[0]} p "
                                                      f"ON p.{parent[1]} = c.{column} WHERE p.{parent[1]} IS NULL"))
                    assert orphans.scalar() == 0, (table, column)
            expected = {f"/data/runs/{str(uuid.UUID(r['user_id']))}/{str(uuid.UUID(r['id']))}/checkpoints/state_1"
                        for t, r in rows if t == "runs"}
            assert set((await conn.execute(text("SELECT path FROM checkpoints"))).scalars()) == expected

        # The foreign keys are back, cascading as before (PostgreSQL enforces them; so does Signal's SQLite).
        async with engine.begin() as conn:
            if conn.dialect.name == "sqlite":
                await conn.execute(text("PRAGMA foreign_keys=ON"))
            user = str(uuid.UUID(rows[0][1]["id"]))
            await conn.execute(text("DELETE FROM users WHERE id = :u"), {"u": user})
            for table in ("api_keys", "runs", "metrics", "samples", "checkpoints", "login_links"):
                assert (await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar() == 1, table
            if conn.dialect.name == "postgresql":
                with pytest.raises(Exception, match="foreign key"):
                    async with conn.begin_nested():
                        await conn.execute(text("INSERT INTO metrics (run_id, step, name, value, created_at) "
                                                "VALUES (:r, 1, 'loss', 1.0, now())"), {"r": new_id()})

        # And back: downgrading past 0003 restores the 32-hex form, references intact.
        await asyncio.to_thread(command.downgrade, config, "0002")
        await engine.dispose()  # pooled connections cached plans of the tables before
        async with engine.connect() as conn:
            for table, column in ID_COLUMNS:
                values = (await conn.execute(text(f"SELECT {column} FROM {table}"))).scalars().all()
                assert len(values) == 1 and all(re.fullmatch(r"[0-9a-f]{32}", v) for v in values), (table, column, values)
    finally:
        await engine.dispose()


def test_runtime_adopts_a_run_directory_written_under_32_hex_ids(tmp_path: Path) -> None:
    user, run = uuid.uuid4().hex, uuid.uuid4().hex
    legacy = RunPaths(tmp_path, user, run)
    legacy.root.mkdir(parents=True)
    write_json(legacy.config, {"run_id": run, "user_id": user, "base_model": "m"})
    (legacy.root / "journal").write_bytes(b"kept")

    root = find_run_dir(tmp_path, str(uuid.UUID(run)))
    assert root == RunPaths(tmp_path, str(uuid.UUID(user)), str(uuid.UUID(run))).root
    assert read_json(root / "config.json")["run_id"] == str(uuid.UUID(run)) and (root / "journal").read_bytes() == b"kept"
    assert not legacy.root.exists() and find_run_dir(tmp_path, str(uuid.UUID(run))) == root
    assert find_run_dir(tmp_path, new_id()) is None
