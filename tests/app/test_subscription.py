"""The `metrics` subscription over graphql-transport-ws streams results while another client trains."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Any

import pytest
import websockets
from websockets.typing import Subprotocol

from app.db import Database
from app.services.users import UserService
from rewardsignal import SignalClient
from rewardsignal.operations import document
from tests.helpers.live_server import LiveServer


async def _connect(live_server: LiveServer, params: dict):  # type: ignore[no-untyped-def]
    ws = await websockets.connect(live_server.url.replace("http", "ws") + "/graphql",
                                  subprotocols=[Subprotocol("graphql-transport-ws")])
    await ws.send(json.dumps({"type": "connection_init", "payload": params}))
    return ws


async def _next(ws, kind: str = "next") -> dict:  # type: ignore[no-untyped-def]
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), timeout=120))
        if message["type"] in (kind, "error", "complete"):
            return message


async def _subscribe(ws, run_id: str) -> None:  # type: ignore[no-untyped-def]
    await ws.send(json.dumps({"id": "1", "type": "subscribe",
                              "payload": {"query": document("Metrics"), "variables": {"runId": run_id}}}))


async def _subscription_error(ws, run_id: str) -> str:  # type: ignore[no-untyped-def]
    """Subscribe, expect a refusal, and return its code."""
    await _subscribe(ws, run_id)
    message = await _next(ws)
    await ws.close()
    errors = message["payload"] if message["type"] == "error" else message["payload"]["errors"]
    return errors[0]["extensions"]["code"]


async def test_events_arrive_as_another_client_trains(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = client.create_run(lora_r=4)
    ws = await _connect(live_server, {"Authorization": f"Bearer {key}"})
    assert (await _next(ws, "connection_ack"))["type"] == "connection_ack"
    await _subscribe(ws, run.id)
    await asyncio.sleep(0.3)  # let the subscription register before training starts

    results: dict[str, Any] = {}

    def trainer() -> None:
        trainer_client = SignalClient(api_key=key, base_url=live_server.url)
        trainer_run = trainer_client.get_run(run.id)
        results["fb"] = trainer_run.forward_backward(batch=[{"text": "streamed while training"}])
        results["opt"] = trainer_run.optim_step()

    thread = threading.Thread(target=trainer)
    thread.start()
    first, second = await _next(ws), await _next(ws)
    thread.join(timeout=120)
    await ws.close()

    fb_event = first["payload"]["data"]["metrics"]
    opt_event = second["payload"]["data"]["metrics"]
    assert fb_event["kind"] == "forward_backward" and fb_event["loss"] == results["fb"]["loss"]
    assert fb_event["numTokens"] == results["fb"]["num_tokens"] and fb_event["step"] == 0
    assert opt_event["kind"] == "optim_step" and opt_event["step"] == 1
    assert opt_event["gradNorm"] == results["opt"]["grad_norm"]


async def test_bad_key_is_refused_at_connection(live_server: LiveServer) -> None:
    ws = await _connect(live_server, {"Authorization": "Bearer sk-wrong"})
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await _next(ws, "connection_ack")
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4403


async def test_another_users_run_cannot_be_watched(live_server: LiveServer, key: str) -> None:
    run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4)
    intruder = live_server.new_user()
    ws = await _connect(live_server, {"apiKey": intruder})
    await _next(ws, "connection_ack")
    assert await _subscription_error(ws, run.id) == "NOT_FOUND"


async def test_a_key_revoked_after_connecting_cannot_subscribe(live_server: LiveServer) -> None:
    owner = live_server.new_user()
    client = SignalClient(api_key=owner, base_url=live_server.url)
    run = client.create_run(lora_r=4)
    spare = client.create_api_key("socket")
    ws = await _connect(live_server, {"Authorization": f"Bearer {spare.secret}"})
    await _next(ws, "connection_ack")
    client.revoke_api_key(spare.api_key.id)
    assert await _subscription_error(ws, run.id) == "UNAUTHENTICATED"


def _disable(live_server: LiveServer, email: str) -> None:
    """An admin disables the user `email`, through the service the admin page calls."""

    async def disable() -> None:
        db = Database(live_server.settings.resolved_database_url)
        try:
            users = UserService(db)
            admin, _ = await users.get_or_create(f"admin-{uuid.uuid4().hex[:8]}@example.com", is_admin=True)
            user = await users.find(email)
            assert user is not None
            await users.set_disabled(admin, user.id)
        finally:
            await db.dispose()

    asyncio.run(disable())  # called in a thread of its own: the test's loop holds the socket


async def _watching(live_server: LiveServer, secret: str, run_id: str):  # type: ignore[no-untyped-def]
    """A socket subscribed to the run's metrics, returned once the subscription is streaming (its first check
    passed and it listens for events): whatever ends it afterwards is the re-check."""
    ws = await _connect(live_server, {"Authorization": f"Bearer {secret}"})
    await _next(ws, "connection_ack")
    await _subscribe(ws, run_id)
    broker = live_server.app.state.services.broker
    await asyncio.to_thread(live_server.wait_for, lambda: broker.subscriber_count(run_id) == 1, "the subscription")
    return ws


async def _ending_code(ws) -> str:  # type: ignore[no-untyped-def]
    """The error the stream ends with (a `next` carrying errors, or an `error`), and that it then completes."""
    message = await _next(ws)
    assert message["type"] != "complete", message
    errors = message["payload"] if message["type"] == "error" else message["payload"]["errors"]
    if message["type"] == "next":
        assert (await _next(ws, "complete"))["type"] == "complete"
    await ws.close()
    return errors[0]["extensions"]["code"]


@pytest.fixture
def quick_recheck(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live_server.app.state.services.settings, "session_recheck_s", 0.2)


@pytest.mark.usefixtures("quick_recheck")
async def test_an_open_subscription_ends_when_its_key_is_revoked(live_server: LiveServer) -> None:
    owner = live_server.new_user()
    client = SignalClient(api_key=owner, base_url=live_server.url)
    run = client.create_run(lora_r=4)
    spare = client.create_api_key("socket")
    ws = await _watching(live_server, spare.secret, run.id)
    await asyncio.to_thread(client.revoke_api_key, spare.api_key.id)
    assert await _ending_code(ws) == "UNAUTHENTICATED"
    broker = live_server.app.state.services.broker
    assert broker.subscriber_count(run.id) == 0  # the broker's queue went with it


@pytest.mark.usefixtures("quick_recheck")
async def test_an_open_subscription_ends_when_its_user_is_disabled(live_server: LiveServer) -> None:
    email = f"user-{uuid.uuid4().hex[:8]}@example.com"
    secret = live_server.new_user(email)
    run = SignalClient(api_key=secret, base_url=live_server.url).create_run(lora_r=4)
    ws = await _watching(live_server, secret, run.id)
    await asyncio.to_thread(_disable, live_server, email)
    assert await _ending_code(ws) == "UNAUTHENTICATED"
