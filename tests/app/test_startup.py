"""Start-up pays for Alembic only when the database is behind: the head revision is read from the migration
files' text and compared with the database's alembic_version (issue 14: imports were most of a 1.6 s start)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

from app.db import alembic_config, at_head, database_revisions, head_revisions, migrate_async
from app.settings import Settings

REPO = Path(__file__).resolve().parents[2]
# A fresh interpreter runs the start-up, so what it imports is its own doing.
START = """
import asyncio, json, sys
from app.settings import Settings
from app.startup import first_start
asyncio.run(first_start(Settings(_env_file=None, data_dir=sys.argv[1], bootstrap_admin=False)))
print(json.dumps({"alembic": "alembic" in sys.modules}))
"""


def test_the_head_read_from_the_files_is_alembics() -> None:
    assert head_revisions() == frozenset(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads())


def test_a_branch_merge_has_one_head(tmp_path: Path) -> None:
    for name, revision, down in (("a", "1", None), ("b", "2a", "1"), ("c", "2b", "1"), ("d", "3", ("2a", "2b"))):
        (tmp_path / f"{name}.py").write_text(f'"""{name}"""\nrevision = {revision!r}\ndown_revision = {down!r}\n')
    assert head_revisions(tmp_path) == {"3"}


def _start(data_dir: Path) -> dict[str, bool]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", START, str(data_dir)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.usefixtures("fresh_database")
def test_alembic_is_imported_only_while_the_database_is_behind(tmp_path: Path) -> None:
    url = Settings(_env_file=None, data_dir=tmp_path).resolved_database_url
    assert asyncio.run(database_revisions(url)) == frozenset()
    assert _start(tmp_path) == {"alembic": True}  # a new database: the migrations run
    assert asyncio.run(at_head(url))
    assert _start(tmp_path) == {"alembic": False}  # at head: nothing to run, nothing imported
    assert asyncio.run(migrate_async(url)) is False
