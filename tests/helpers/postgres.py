"""A throwaway PostgreSQL server for tests: initdb in a temp dir, loopback only, as the postgres user
(PostgreSQL refuses to run as root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.live_server import free_port


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    return next((str(v / name) for v in versions if (v / name).exists()), None)


def available() -> bool:
    return _binary("initdb") is not None and _binary("pg_ctl") is not None


def _as_postgres(args: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args


@contextmanager
def postgres_server() -> Iterator[str]:
    """Yields an asyncpg SQLAlchemy URL of a fresh database; stops and removes the server after."""
    root = Path(tempfile.mkdtemp(prefix="signal-pg-"))
    data = root / "data"
    port = free_port()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    subprocess.run(_as_postgres([_binary("initdb"), "-D", str(data), "-U", "signal", "--auth=trust", "-E", "UTF8"]),
                   check=True, capture_output=True)
    options = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={root} -c fsync=off"
    subprocess.run(_as_postgres([_binary("pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "log"),
                                 "-w", "start"]), check=True, capture_output=True)
    try:
        for _ in range(100):
            ready = subprocess.run(["pg_isready", "-h", "127.0.0.1", "-p", str(port)], capture_output=True)
            if ready.returncode == 0:
                break
            time.sleep(0.1)
        subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(port), "-U", "signal", "-d", "postgres", "-c",
                        "CREATE DATABASE signal"], check=True, capture_output=True)
        yield f"postgresql+asyncpg://signal@127.0.0.1:{port}/signal"
    finally:
        subprocess.run(_as_postgres([_binary("pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
