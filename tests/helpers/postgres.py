"""A throwaway PostgreSQL server for tests: initdb in a temp dir, loopback only, as the postgres user
(PostgreSQL refuses to run as root). One server serves a whole test session (`Cluster`); each test module
gets a fresh database on it (`Cluster.create_database`)."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.live_server import free_port

# Cluster-wide roles, made once per server: Supabase's client roles (the RLS test uses them; the service role
# bypasses RLS as Supabase's does). NOLOGIN: as in PostgREST, a session only ever SETs ROLE to them.
ROLES_SQL = """
CREATE ROLE anon NOLOGIN NOINHERIT;
CREATE ROLE authenticated NOLOGIN NOINHERIT;
CREATE ROLE service_role NOLOGIN NOINHERIT BYPASSRLS;
"""


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    found = next((str(v / name) for v in versions if (v / name).exists()), None)
    if found is None:
        raise FileNotFoundError(f"PostgreSQL's {name} is not installed (apt-get install postgresql)")
    return found


def available() -> bool:
    try:
        return all(_binary(name) for name in ("initdb", "pg_ctl", "psql"))
    except FileNotFoundError:
        return False


def _as_postgres(args: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args


@dataclass
class Cluster:
    """A running server: `signal` is its superuser (trust auth, loopback only)."""

    root: Path
    port: int
    _names = itertools.count(1)

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str, driver: str = "postgresql+asyncpg") -> str:
        return f"{driver}://signal@127.0.0.1:{self.port}/{database}"

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run `sql` as the superuser; stops at the first error and raises with PostgreSQL's message."""
        done = subprocess.run([_binary("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "signal", "-d", database,
                               "-v", "ON_ERROR_STOP=1", "-X", "-q", "-At", "-c", sql], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"psql failed: {done.stderr.strip()}")
        return done.stdout

    def create_database(self, hint: str = "signal") -> str:
        """A fresh, empty database; returns its name."""
        name = f"{re.sub(r'[^a-z0-9_]', '_', hint.lower())[-40:]}_{next(self._names)}"
        self.psql(f'CREATE DATABASE "{name}"')
        return name

    def drop_database(self, name: str) -> None:
        # FORCE ends connections a server of the module may still hold in its pool.
        self.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    @classmethod
    @contextmanager
    def start(cls) -> Iterator[Cluster]:
        root = Path(tempfile.mkdtemp(prefix="signal-pg-"))
        if os.geteuid() == 0:
            shutil.chown(root, "postgres", "postgres")
        cluster = cls(root, free_port())
        subprocess.run(_as_postgres([_binary("initdb"), "-D", str(cluster.data), "-U", "signal", "--auth=trust", "-E", "UTF8"]),
                       check=True, capture_output=True)
        options = (f"-c listen_addresses=127.0.0.1 -c port={cluster.port} -c unix_socket_directories={root} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300")
        # pg_ctl -w returns once the server accepts connections: the readiness condition, no polling of ours.
        subprocess.run(_as_postgres([_binary("pg_ctl"), "-D", str(cluster.data), "-o", options, "-l", str(root / "log"),
                                     "-w", "-t", "120", "start"]), check=True, capture_output=True)
        try:
            cluster.psql(ROLES_SQL)
            yield cluster
        finally:
            subprocess.run(_as_postgres([_binary("pg_ctl"), "-D", str(cluster.data), "-m", "immediate", "stop"]),
                           capture_output=True)
            shutil.rmtree(root, ignore_errors=True)


@contextmanager
def postgres_server() -> Iterator[str]:
    """A server of its own with one fresh database: yields its asyncpg SQLAlchemy URL."""
    with Cluster.start() as cluster:
        yield cluster.url(cluster.create_database())
