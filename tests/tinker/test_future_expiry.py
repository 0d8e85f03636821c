"""A finished Tinker future is kept SIGNAL_TINKER_RESULT_TTL_S, then its row is deleted and its id answers 404."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from app.db import Database
from app.tables import TinkerFuture
from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for

RESULT_TTL_S = 1.0  # tiny here, so the sweep deletes the row within the test's patience (the product keeps 3600 s)


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer.start(settings_for(Path(tmp_path_factory.mktemp("tinker-expiry")), tiny_model_dir,
                                           tinker_poll_s=5.0, tinker_result_ttl_s=RESULT_TTL_S))
    yield server
    server.stop()


def row_exists(server: LiveServer, request_id: str) -> bool:
    async def read() -> bool:
        db = Database(server.settings.resolved_database_url)
        try:
            async with db.session() as session:
                return await session.get(TinkerFuture, request_id) is not None
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:  # a loop of its own, as LiveServer.new_user does
        return pool.submit(asyncio.run, read()).result()


def test_an_expired_future_is_deleted_and_answers_404(live_server: LiveServer) -> None:
    headers = {"X-API-Key": "tml-" + live_server.new_user()}

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{live_server.url}/api/v1/{path}", json=body, headers=headers, timeout=60)

    session = post("create_session", {"tags": []}).json()["session_id"]
    request_id = post("create_model", {"session_id": session, "model_seq_id": 0, "base_model": TINY_MODEL,
                                       "lora_config": {"rank": 4}}).json()["request_id"]
    answer = post("retrieve_future", {"request_id": request_id})
    for _ in range(60):  # bounded: each pending poll is held up to tinker_poll_s
        if answer.json().get("type") != "try_again":
            break
        answer = post("retrieve_future", {"request_id": request_id})
    assert answer.status_code == 200 and answer.json() == {"model_id": f"{session}:train:0", "type": "create_model"}

    live_server.wait_for(lambda: not row_exists(live_server, request_id), "the sweep to delete the expired row",
                         timeout=30)
    gone = post("retrieve_future", {"request_id": request_id})
    assert gone.status_code == 404 and request_id in gone.json()["detail"]
