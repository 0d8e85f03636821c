"""The server's signing secret (app/security.py) when several server processes start at once on a fresh data
directory: they must all sign with one non-empty secret, or a cookie from one is refused by another (and an empty
key would sign cookies anyone can forge). It was created empty, then written, so a process starting beside it could
read "" and sign with that."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from app.security import server_secret
from app.settings import Settings

STARTS = 8


def _secret(data_dir: str, barrier: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    barrier.wait()
    out.put(server_secret(Settings(_env_file=None, data_dir=data_dir, session_secret="")))


@pytest.mark.parametrize("attempt", range(3))
def test_servers_starting_at_once_sign_with_one_nonempty_secret(tmp_path: Path, attempt: int) -> None:
    context = multiprocessing.get_context("fork")
    barrier, out = context.Barrier(STARTS), context.Queue()
    processes = [context.Process(target=_secret, args=(str(tmp_path), barrier, out)) for _ in range(STARTS)]
    for process in processes:
        process.start()
    secrets = {out.get(timeout=60) for _ in processes}
    for process in processes:
        process.join(timeout=60)
    assert len(secrets) == 1 and len(secrets.pop()) >= 48
    assert [p.name for p in tmp_path.iterdir()] == ["session_secret"]  # no draft left behind
    assert (tmp_path / "session_secret").stat().st_mode & 0o777 == 0o600


def test_an_empty_secret_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "session_secret").write_text("")
    with pytest.raises(RuntimeError, match="session_secret is empty"):
        server_secret(Settings(_env_file=None, data_dir=str(tmp_path), session_secret=""))
