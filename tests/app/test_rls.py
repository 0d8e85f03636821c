"""Supabase row-level security (supabase/migrations/*_rls_security.sql) on a real PostgreSQL.

As on Supabase: Alembic creates the tables, then the SQL file enables RLS, writes the policies and sets the grants.
A stand-in for Supabase's `auth` schema and its default grants comes first. Every client query runs as PostgREST
runs it: in a transaction, `SET LOCAL ROLE` to anon or authenticated, the JWT's claims in `request.jwt.claims`;
never as the table owner.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from app.db import migrate
from app.tables import Base, new_id

REPO = Path(__file__).resolve().parents[2]
# Applied in order, as `supabase db push` does: the first opens reads, later ones close new server-only tables.
RLS_SQL = sorted((REPO / "supabase" / "migrations").glob("*.sql"))

# What Supabase sets up before any project migration (a stand-in: the roles are the session server's, made once).
SUPABASE_STANDIN = """
create schema auth;
create function auth.uid() returns uuid language sql stable as $$
  select nullif(current_setting('request.jwt.claims', true)::json->>'sub', '')::uuid
$$;
grant usage on schema auth to anon, authenticated, service_role;
grant usage on schema public to anon, authenticated, service_role;
alter default privileges in schema public grant all on tables to anon, authenticated, service_role;
alter default privileges in schema public grant all on sequences to anon, authenticated, service_role;
alter default privileges in schema public grant all on functions to anon, authenticated, service_role;
"""

# Tables a signed-in user reads their own rows of, and how a row names its owner.
OWNED = {"users": "id", "api_keys": "user_id", "runs": "user_id"}
THROUGH_RUN = ["metrics", "samples", "checkpoints"]
KEY_DISPLAY = "id, user_id, name, prefix, created_at, last_used_at, revoked_at"
ALL_TABLES = sorted(Base.metadata.tables) + ["alembic_version"]
# The server's alone (login links and attempts, billing's outbox, Alembic's bookkeeping): no client reads them.
SERVER_ONLY = [t for t in ALL_TABLES if t not in OWNED and t not in THROUGH_RUN]


@dataclass
class World:
    url: str
    a: dict[str, str]
    b: dict[str, str]


def seed(user: str, tag: str) -> str:
    run = new_id()
    return f"""
insert into users (id, email, name, is_admin, created_at) values ('{user}', '{tag}@example.com', '{tag}', false, now());
insert into api_keys (id, user_id, name, prefix, key_hash, created_at)
  values ('{new_id()}', '{user}', 'k', 'sk-{tag}', '{uuid.uuid4().hex * 2}', now());
insert into runs (id, user_id, base_model, lora_config, optimizer_config, seed, gpu_config, status, step,
                  trainable_params, total_params, created_at, updated_at)
  values ('{run}', '{user}', 'tiny', '{{}}', '{{}}', 0, '', 'active', 1, 1, 2, now(), now());
insert into metrics (run_id, step, name, value, created_at) values ('{run}', 1, 'loss', 1.5, now());
insert into samples (run_id, step, prompt, output, params, created_at) values ('{run}', 1, 'p', 'o', '{{}}', now());
insert into checkpoints (run_id, step, mode, path, size_bytes, created_at)
  values ('{run}', 1, 'state', '/data/runs/{user}/{run}/checkpoints/state_1', 10, now());
insert into login_links (token_hash, user_id, created_at, expires_at) values ('{uuid.uuid4().hex * 2}', '{user}', now(), now());
insert into login_attempts (state, code_verifier, next_path, created_at, expires_at)
  values ('{uuid.uuid4().hex}', 'v', '/', now(), now());
insert into sessions (id_hash, user_id, created_at, last_seen_at, expires_at, user_agent)
  values ('{uuid.uuid4().hex * 2}', '{user}', now(), now(), now() + interval '1 day', 'Chrome on Linux');
insert into playground_streams (id_hash, user_id, panes, created_at, expires_at)
  values ('{uuid.uuid4().hex * 2}', '{user}', '[{{"prompt": "secret"}}]', now(), now() + interval '10 minutes');
insert into run_sessions (run_id, session, last_seq, ticket, updated_at) values ('{run}', 'pipeline', 1, 1, now());
"""


@pytest.fixture(scope="module")
def world(postgres_cluster, postgres_url: str) -> Iterator[World]:  # type: ignore[no-untyped-def]
    assert RLS_SQL[0].name.endswith("_rls_security.sql"), RLS_SQL
    database = postgres_url.rsplit("/", 1)[1]
    postgres_cluster.psql(SUPABASE_STANDIN, database)
    migrate(postgres_url)  # Alembic creates the tables, as `signal migrate` does
    for _ in range(2):  # applying them twice is harmless
        for sql in RLS_SQL:
            postgres_cluster.psql(sql.read_text(), database)
    a, b = new_id(), new_id()
    postgres_cluster.psql(seed(a, "a") + seed(b, "b"), database)
    yield World(postgres_url.replace("postgresql+asyncpg", "postgresql"), {"sub": a, "role": "authenticated"},
                {"sub": b, "role": "authenticated"})


@asynccontextmanager
async def client(world: World, role: str, claims: dict[str, str] | None = None) -> AsyncIterator[asyncpg.Connection]:
    """A connection acting as PostgREST does for one request; rolled back after."""
    conn = await asyncpg.connect(world.url)
    try:
        transaction = conn.transaction()
        await transaction.start()
        await conn.execute(f"set local role {role}")
        await conn.execute("select set_config('request.jwt.claims', $1, true)", json.dumps(claims or {"role": role}))
        assert await conn.fetchval("select current_user") == role
        try:
            yield conn
        finally:
            await transaction.rollback()
    finally:
        await conn.close()


def columns(table: str) -> str:
    return KEY_DISPLAY if table == "api_keys" else "*"


async def owner_of(conn: asyncpg.Connection, table: str, row: asyncpg.Record) -> str:
    if table in OWNED:
        return row[OWNED[table]]
    return await conn.fetchval("select user_id from runs where id = $1", row["run_id"])


def test_every_public_table_has_row_level_security(world: World, postgres_cluster) -> None:  # type: ignore[no-untyped-def]
    database = world.url.rsplit("/", 1)[1]
    tables = postgres_cluster.psql("select relname || ':' || relrowsecurity from pg_class c join pg_namespace n "
                                   "on n.oid = c.relnamespace where n.nspname = 'public' and c.relkind in ('r', 'p') "
                                   "order by 1", database).split()
    assert sorted(t.split(":")[0] for t in tables) == sorted(ALL_TABLES)  # the test covers every table there is
    assert [t for t in tables if not t.endswith(":true")] == []


@pytest.mark.parametrize("table", [*OWNED, *THROUGH_RUN])
async def test_a_reads_its_own_rows_and_none_of_bs(world: World, table: str) -> None:
    async with client(world, "authenticated", world.a) as conn:
        rows = await conn.fetch(f"select {columns(table)} from {table}")
        assert len(rows) == 1, rows  # A's own row, found
        assert [await owner_of(conn, table, row) for row in rows] == [world.a["sub"]]
    async with client(world, "authenticated", world.b) as conn:  # and B's, by B alone
        rows = await conn.fetch(f"select {columns(table)} from {table}")
        assert [await owner_of(conn, table, row) for row in rows] == [world.b["sub"]]


@pytest.mark.parametrize("table", SERVER_ONLY)
async def test_server_only_tables_are_closed_to_signed_in_users(world: World, table: str) -> None:
    async with client(world, "authenticated", world.a) as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.fetch(f"select * from {table}")


@pytest.mark.parametrize("table", ALL_TABLES)
async def test_anon_sees_nothing(world: World, table: str) -> None:
    async with client(world, "anon") as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.fetch(f"select count(*) from {table}")


@pytest.mark.parametrize("role", ["anon", "authenticated"])
@pytest.mark.parametrize("query", ["select key_hash from api_keys", "select * from api_keys",
                                   "select count(*) from api_keys where key_hash like 'a%'"])
async def test_key_hash_is_unreadable(world: World, role: str, query: str) -> None:
    async with client(world, role, world.a if role == "authenticated" else None) as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.fetch(query)


def writes(a: str) -> dict[str, str]:
    """A write per (table, kind) that a client would like to make, A's own rows included."""
    run = f"(select id from runs where user_id = '{a}')"
    inserts = {
        "users": f"insert into users (id, email, name, is_admin, created_at) values ('{new_id()}', 'x@example.com', '', true, now())",
        "api_keys": f"insert into api_keys (id, user_id, name, prefix, key_hash, created_at) "
                    f"values ('{new_id()}', '{a}', 'mine', 'sk-x', '{'0' * 64}', now())",  # a key hash of its choosing
        "runs": f"insert into runs (id, user_id, base_model, lora_config, optimizer_config, seed, gpu_config, status, step, "
                f"trainable_params, total_params, created_at, updated_at) "
                f"values ('{new_id()}', '{a}', 'tiny', '{{}}', '{{}}', 0, '', 'active', 0, 0, 0, now(), now())",
        "metrics": f"insert into metrics (run_id, step, name, value, created_at) values ({run}, 2, 'loss', 0, now())",
        "samples": f"insert into samples (run_id, step, prompt, output, params, created_at) values ({run}, 2, 'p', 'o', '{{}}', now())",
        "checkpoints": f"insert into checkpoints (run_id, step, mode, path, size_bytes, created_at) "
                       f"values ({run}, 2, 'state', '/etc', 1, now())",  # a planted checkpoint path
        "login_links": f"insert into login_links (token_hash, user_id, created_at, expires_at) values ('{'1' * 64}', '{a}', now(), now())",
        "login_attempts": "insert into login_attempts (state, code_verifier, next_path, created_at, expires_at) "
                          "values ('s', 'v', '/', now(), now())",
        "alembic_version": "insert into alembic_version (version_num) values ('9999')",
        "sessions": f"insert into sessions (id_hash, user_id, created_at, last_seen_at, expires_at, user_agent) "
                    f"values ('{'2' * 64}', '{a}', now(), now(), now() + interval '1 day', 'x')",  # a session of its own
        "playground_streams": f"insert into playground_streams (id_hash, user_id, panes, created_at, expires_at) "
                              f"values ('{'3' * 64}', '{a}', '[]', now(), now())",  # a stream id of its choosing
        "run_sessions": f"insert into run_sessions (run_id, session, last_seq, ticket, updated_at) "
                        f"values ({run}, 'x', 99, 99, now())",  # skipping its own calls' order
    }
    updates = {
        "users": f"update users set is_admin = true where id = '{a}'",  # making itself an admin
        "api_keys": f"update api_keys set revoked_at = null, name = 'x' where user_id = '{a}'",
        "runs": f"update runs set user_id = '{a}', status = 'active'",
        "checkpoints": "update checkpoints set path = '/etc'",
        "alembic_version": "update alembic_version set version_num = '0001'",
        "sessions": f"update sessions set revoked_at = null, expires_at = now() + interval '1 year' where user_id = '{a}'",
        "run_sessions": "update run_sessions set last_seq = 99",
    }
    kinds: dict[str, str] = {}
    for table in ALL_TABLES:
        kinds[f"{table}:insert"] = inserts.get(table, f"insert into {table} default values")
        kinds[f"{table}:update"] = updates.get(table, f"update {table} set created_at = now()")
        kinds[f"{table}:delete"] = f"delete from {table}"
    return kinds


@pytest.mark.parametrize("role", ["anon", "authenticated"])
@pytest.mark.parametrize("write", sorted(writes(new_id())))
async def test_clients_cannot_write(world: World, role: str, write: str) -> None:
    sql = writes(world.a["sub"])[write]
    async with client(world, role, world.a if role == "authenticated" else None) as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(sql)


@pytest.mark.parametrize("table", ["sessions", "playground_streams", "run_sessions", "openai_responses"])
def test_server_only_tables_have_a_deny_all_policy(world: World, postgres_cluster,  # type: ignore[no-untyped-def]
                                                   table: str) -> None:
    # Closed by a policy too, not only by the missing grant: a grant added by mistake still shows no row.
    database = world.url.rsplit("/", 1)[1]
    policies = postgres_cluster.psql("select policyname || ':' || permissive || ':' || qual from pg_policies "
                                     f"where tablename = '{table}'", database).strip()
    assert policies == f"{table}: no client access:RESTRICTIVE:false"
