"""The futures protocol on the wire itself (raw HTTP, as the SDK sends it): resubmissions, try_again, sessions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for

POLL_S = 1.0  # SIGNAL_TINKER_POLL_S here, so a pending poll's try_again comes within the test's patience
WOKEN_POLL_S = 40.0  # the other server's, in the wake-up test: the most the setting allows


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer.start(settings_for(Path(tmp_path_factory.mktemp("tinker-futures")), tiny_model_dir,
                                           tinker_poll_s=POLL_S))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def wire(live_server: LiveServer) -> Any:
    headers = {"X-API-Key": "tml-" + live_server.new_user()}

    def post(path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{live_server.url}/api/v1/{path}", headers=headers, timeout=60, **kwargs)

    post.headers = headers  # type: ignore[attr-defined]  # the key, for requests to another server
    return post


def result(wire: Any, request_id: str) -> dict[str, Any]:
    while True:  # the SDK's loop: try_again is re-polled at once, the server holds each poll
        answer = wire("retrieve_future", json={"request_id": request_id}).json()
        if answer.get("type") != "try_again":
            return dict(answer)


@pytest.fixture(scope="module")
def model(wire: Any) -> str:
    session = wire("create_session", json={"tags": [], "display_name": "futures"}).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": TINY_MODEL, "lora_config": {"rank": 4}}
    first, again = wire("create_model", json=body).json(), wire("create_model", json=body).json()
    # A resubmission (same session and model_seq_id) gets the first request_id, and creates no second run.
    assert again["request_id"] == first["request_id"] and first["model_id"] == f"{session}:train:0"
    assert result(wire, first["request_id"]) == {"model_id": f"{session}:train:0", "type": "create_model"}
    return str(first["model_id"])


def test_a_resubmitted_operation_keeps_its_request_id_whatever_the_body(wire: Any, model: str) -> None:
    first = wire("optim_step", json={"model_id": model, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}})
    again = wire("optim_step", json={"model_id": model, "seq_id": 1, "adam_params": {"learning_rate": 0.5}})
    assert first.status_code == again.status_code == 200
    assert first.json()["request_id"] == again.json()["request_id"]
    failed = result(wire, first.json()["request_id"])  # no forward_backward before it: the user's error
    assert failed["category"] == "user" and "forward_backward" in failed["error"]


def test_a_later_seq_id_never_waits_at_submit_and_polls_answer_try_again(wire: Any, model: str) -> None:
    # seq 3 with seq 2 not yet sent: the POST answers at once; the operation waits for seq 2 in the background.
    ahead = wire("optim_step", json={"model_id": model, "seq_id": 3, "adam_params": {}})
    assert ahead.status_code == 200
    poll = wire("retrieve_future", json={"request_id": ahead.json()["request_id"]})
    assert poll.status_code == 200 and poll.json()["type"] == "try_again"


def test_unknown_and_foreign_futures_are_404(live_server: LiveServer, wire: Any, model: str) -> None:
    mine = wire("optim_step", json={"model_id": model, "seq_id": 1}).json()["request_id"]
    other = {"X-API-Key": "tml-" + live_server.new_user()}
    foreign = httpx.post(f"{live_server.url}/api/v1/retrieve_future", json={"request_id": mine}, headers=other)
    assert foreign.status_code == 404 and foreign.json()["detail"]
    unknown_model = httpx.post(f"{live_server.url}/api/v1/optim_step", json={"model_id": model, "seq_id": 9},
                               headers=other)
    assert unknown_model.status_code == 404


def test_a_finished_session_answers_410(wire: Any) -> None:
    session = wire("create_session", json={"tags": []}).json()["session_id"]
    assert wire("session_heartbeat", json={"session_id": session}).json() == {"type": "session_heartbeat"}
    assert wire(f"sessions/{session}/finish", json={"reason": {"type": "success"}}).status_code == 200
    assert wire("session_heartbeat", json={"session_id": session}).status_code == 410
    refused = wire("create_model", json={"session_id": session, "model_seq_id": 0, "base_model": TINY_MODEL})
    assert refused.status_code == 410


def test_a_finished_sessions_model_refuses_operations_but_its_info_stays(wire: Any) -> None:
    session = wire("create_session", json={"tags": []}).json()["session_id"]
    created = wire("create_model", json={"session_id": session, "model_seq_id": 0, "base_model": TINY_MODEL,
                                         "lora_config": {"rank": 4}}).json()
    result(wire, created["request_id"])
    wire(f"sessions/{session}/finish", json={"reason": {"type": "success"}})
    refused = wire("optim_step", json={"model_id": created["model_id"], "seq_id": 1})
    assert refused.status_code == 410 and session in refused.json()["detail"]
    info = wire("get_info", json={"model_id": created["model_id"]}).json()
    assert info["model_data"]["model_name"] == TINY_MODEL and info["lora_rank"] == 4


def test_client_config(live_server: LiveServer, wire: Any) -> None:
    config = wire("client/config", json={"sdk_version": "0.38.0"}).json()
    assert config == {"pjwt_auth_enabled": False, "fwdbwd_max_chunk_len": live_server.settings.max_batch_size,
                      "fwdbwd_max_chunk_bytes_count": live_server.settings.max_request_bytes // 2,
                      "proto_compress_fwdbwd": True, "sample_max_concurrent_requests": 64,
                      "custom_loss_server_side": True}  # create_custom_loss is served (test_custom_loss.py)
    assert wire("telemetry", json={"events": []}).json() == {"status": "accepted"}
    assert wire("client/dynamic_config", json={}).status_code == 404


def test_submit_through_one_server_and_retrieve_through_another(live_server: LiveServer, wire: Any, model: str,
                                                                tmp_path: Path, tiny_model_dir: str) -> None:
    """Two server processes on one database: the second reads the row the first stores (its shared poll wakes
    the waiting poll), with nothing of the future in its memory."""
    other = LiveServer.start(settings_for(tmp_path, tiny_model_dir, database_url=live_server.settings
                                          .resolved_database_url, tinker_poll_s=POLL_S), wait_for_runtime=False)
    try:
        session = wire("create_session", json={"tags": []}).json()["session_id"]
        submitted = wire("create_model", json={"session_id": session, "model_seq_id": 0, "base_model": TINY_MODEL,
                                               "lora_config": {"rank": 4, "train_mlp": False}}).json()
        via_other = httpx.post(f"{other.url}/api/v1/retrieve_future", json={"request_id": submitted["request_id"]},
                               headers=wire.headers, timeout=60)
        while via_other.json().get("type") == "try_again":
            via_other = httpx.post(f"{other.url}/api/v1/retrieve_future",
                                   json={"request_id": submitted["request_id"]}, headers=wire.headers, timeout=60)
        assert via_other.status_code == 200
        assert via_other.json() == {"model_id": f"{session}:train:0", "type": "create_model"}
    finally:
        other.stop()


def test_a_poll_on_another_server_is_woken_by_the_completion(live_server: LiveServer, wire: Any, tmp_path: Path,
                                                              tiny_model_dir: str) -> None:
    """A future pending in one process, polled in another whose poll would hold 40 s: the completion wakes that poll
    (NOTIFY on PostgreSQL, the shared poll on SQLite), so it answers within half of that, with the result."""
    from concurrent.futures import ThreadPoolExecutor

    other = LiveServer.start(settings_for(tmp_path, tiny_model_dir, database_url=live_server.settings
                                          .resolved_database_url, tinker_poll_s=WOKEN_POLL_S), wait_for_runtime=False)
    try:
        session = wire("create_session", json={"tags": []}).json()["session_id"]
        created = wire("create_model", json={"session_id": session, "model_seq_id": 0, "base_model": TINY_MODEL,
                                             "lora_config": {"rank": 4}}).json()
        result(wire, created["request_id"])
        # seq 2 before seq 1: pending until seq 1 comes (an optim_step without gradients: a user error, each).
        ahead = wire("optim_step", json={"model_id": created["model_id"], "seq_id": 2}).json()["request_id"]
        waits = other.app.state.services.tinker._remote
        with ThreadPoolExecutor(1) as pool:
            poll = pool.submit(httpx.post, f"{other.url}/api/v1/retrieve_future", json={"request_id": ahead},
                               headers=wire.headers, timeout=60)
            other.wait_for(lambda: ahead in waits, "the other server's poll to wait on the future", timeout=30)
            wire("optim_step", json={"model_id": created["model_id"], "seq_id": 1})
            answer = poll.result(timeout=WOKEN_POLL_S / 2)  # unwoken, it would answer only at WOKEN_POLL_S
        assert answer.status_code == 200 and answer.json()["category"] == "user"
        assert "forward_backward" in answer.json()["error"]
    finally:
        other.stop()


def test_a_pending_future_whose_owner_went_silent_fails_with_the_server_category(live_server: LiveServer) -> None:
    """The row a dead owner process leaves behind: pending, its heartbeat older than OWNER_SILENCE. The live server's
    heartbeat round fails it (announcing it to other processes' polls), and the poll answers the server's error."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    from app.db import Database
    from app.services.keys import KeyService
    from app.services.tinker_futures import HEARTBEAT_SECONDS, OWNER_SILENCE
    from app.services.users import UserService
    from app.tables import TinkerFuture, utcnow

    async def orphan() -> tuple[str, str]:
        db = Database(live_server.settings.resolved_database_url)
        try:
            user, _ = await UserService(db).get_or_create("orphaned-future@example.com")
            secret, _ = await KeyService(db).create(user, "test")
            row = TinkerFuture(user_id=user.id, key_kind="train", key_scope="gone:train:0", key_seq=1,
                               request_type="OptimStep", owner="a-process-that-died",
                               heartbeat_at=utcnow() - OWNER_SILENCE - timedelta(seconds=1))
            async with db.session() as session:
                session.add(row)
            return secret, row.request_id
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:
        secret, request_id = pool.submit(asyncio.run, orphan()).result()
    headers = {"X-API-Key": "tml-" + secret}
    answer: dict[str, Any] = {"type": "try_again"}
    for _ in range(int(3 * HEARTBEAT_SECONDS / POLL_S)):  # bounded: a heartbeat round comes every HEARTBEAT_SECONDS
        answer = httpx.post(f"{live_server.url}/api/v1/retrieve_future", json={"request_id": request_id},
                            headers=headers, timeout=60).json()
        if answer.get("type") != "try_again":
            break
    assert answer == {"error": "the server process running this operation stopped", "category": "server"}
