"""ids fit Supabase: every id and user_id column holds a dashed UUID (36 characters), existing rows included

Supabase's user ids are UUIDs and `auth.uid()` returns `uuid`: the row-level-security policies compare
`auth.uid()::text` with `user_id`, so Signal's own ids take the same text form. Rows written before this
revision hold 32 hex characters; each is rewritten as 8-4-4-4-12, in parents and children alike, and so are the
run and user directories inside stored checkpoint paths (the runtime adopts legacy directories on first use:
gpu_runtime.client.persistence.find_run_dir).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-10 12:00:00
"""

import re

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

# (table, column, length before, referenced table): every column holding a user or run id.
ID_COLUMNS = [
    ("users", "id", 36, None),
    ("api_keys", "id", 32, None),
    ("api_keys", "user_id", 36, "users"),
    ("login_links", "user_id", 36, "users"),
    ("runs", "id", 32, None),
    ("runs", "user_id", 36, "users"),
    ("metrics", "run_id", 32, "runs"),
    ("samples", "run_id", 32, "runs"),
    ("checkpoints", "run_id", 32, "runs"),
]
HEX = re.compile(r"[0-9a-f]{32}")


def _dashed(column: str) -> str:
    # Portable SQL (SQLite and PostgreSQL): 8-4-4-4-12 of a 32-character value.
    parts = [(1, 8), (9, 4), (13, 4), (17, 4), (21, 12)]
    return " || '-' || ".join(f"substr({column}, {start}, {length})" for start, length in parts)


def _dash(value: str) -> str:
    return "-".join([value[:8], value[8:12], value[12:16], value[16:20], value[20:]])


def _foreign_keys() -> list[tuple[str, dict]]:
    inspector = sa.inspect(op.get_bind())
    tables = {table for table, *_ in ID_COLUMNS}
    return [(table, fk) for table in sorted(tables) for fk in inspector.get_foreign_keys(table)
            if fk["referred_table"] in ("users", "runs")]


def _rewrite_paths(convert) -> None:  # type: ignore[no-untyped-def]
    """Checkpoint paths name runs/{user_id}/{run_id}: rewrite both segments (called before the ids change)."""
    bind = op.get_bind()
    rows = bind.execute(sa.text("SELECT c.id, c.path, c.run_id, r.user_id FROM checkpoints c JOIN runs r ON r.id = c.run_id"))
    for checkpoint_id, path, run_id, user_id in rows.fetchall():
        new = path
        for old in (run_id, user_id):
            replacement = convert(old)
            if replacement != old:
                new = new.replace(f"/{old}/", f"/{replacement}/").replace(f"/{old}", f"/{replacement}")
        if new != path:
            bind.execute(sa.text("UPDATE checkpoints SET path = :p WHERE id = :i"), {"p": new, "i": checkpoint_id})


def _retype(sqlite: bool, table: str, column: str, old: sa.String, new: sa.String) -> None:
    if old.length == new.length:
        return
    if sqlite:
        # SQLite cannot alter a column: batch mode rebuilds the table (foreign keys are not enforced meanwhile).
        with op.batch_alter_table(table) as batch:
            batch.alter_column(column, type_=new, existing_type=old, existing_nullable=False)
    else:
        op.alter_column(table, column, type_=new, existing_type=old, existing_nullable=False)


def _convert(to_dashed: bool) -> None:
    bind = op.get_bind()
    sqlite = bind.dialect.name == "sqlite"
    if to_dashed:
        _rewrite_paths(lambda v: _dash(v) if HEX.fullmatch(v) else v)
    else:
        _rewrite_paths(lambda v: v.replace("-", "") if len(v) == 36 and HEX.fullmatch(v.replace("-", "")) else v)
    # PostgreSQL checks foreign keys on every UPDATE: drop them while parents and children change, then put them
    # back as they were. (SQLite: migrations run on a connection without PRAGMA foreign_keys, so nothing checks.)
    foreign_keys = [] if sqlite else _foreign_keys()
    for table, fk in foreign_keys:
        op.drop_constraint(fk["name"], table, type_="foreignkey")
    for table, column, before, _ in ID_COLUMNS:
        old, new = (sa.String(length=before), sa.String(length=36)) if to_dashed else (sa.String(length=36), sa.String(length=before))
        if to_dashed:
            _retype(sqlite, table, column, old, new)
            op.execute(f"UPDATE {table} SET {column} = {_dashed(column)} "
                       f"WHERE length({column}) = 32 AND {column} NOT LIKE '%-%'")
        else:
            op.execute(f"UPDATE {table} SET {column} = replace({column}, '-', '') WHERE length({column}) = 36")
            _retype(sqlite, table, column, old, new)
    for table, fk in foreign_keys:
        op.create_foreign_key(fk["name"], table, fk["referred_table"], fk["constrained_columns"], fk["referred_columns"],
                              ondelete=fk["options"].get("ondelete"))


def upgrade() -> None:
    _convert(to_dashed=True)


def downgrade() -> None:
    _convert(to_dashed=False)
