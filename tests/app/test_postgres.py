"""The same migrations and the same server on a real PostgreSQL (started by the test, loopback only)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rewardsignal import NotFoundError, SignalClient
from tests.helpers.live_server import LiveServer, settings_for


@pytest.fixture(scope="module")
def pg_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory, postgres_url: str) -> Iterator[LiveServer]:
    # On PostgreSQL whichever database the rest of the suite uses (postgres_url: the session's server).
    server = LiveServer.start(settings_for(tmp_path_factory.mktemp("pg-data"), tiny_model_dir, database_url=postgres_url))
    yield server
    server.stop()


def test_training_and_ownership_on_postgres(pg_server: LiveServer) -> None:
    assert pg_server.settings.resolved_database_url.startswith("postgresql+asyncpg://")
    owner, intruder = pg_server.new_user(), pg_server.new_user()
    client = SignalClient(api_key=owner, base_url=pg_server.url)
    run = client.create_run(lora_r=4)
    losses = []
    for _ in range(3):
        losses.append(run.forward_backward(batch=[{"text": "stored in PostgreSQL"}]).loss)
        run.optim_step(learning_rate=0.01)
    assert [m.value for m in run.metrics(name="loss:mean")] == losses
    stored = client.get_run(run.id)
    assert stored.step == 3 and stored.info.created_at.endswith("+00:00")
    assert run.save_state().size_bytes > 0
    with pytest.raises(NotFoundError):
        SignalClient(api_key=intruder, base_url=pg_server.url).get_run(run.id)
    assert run.delete() is True and client.list_runs() == []
