from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.live_server import LiveServer, settings_for


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer.start(settings_for(tmp_path_factory.mktemp("signal-data"), tiny_model_dir))
    yield server
    server.stop()


@pytest.fixture
def key(live_server: LiveServer) -> str:
    return live_server.new_user()
