"""A client going away (issue 19 §3): a GraphQL sample, or a /v1 completion without a stream, whose client leaves
mid-decode is withdrawn within a chunk (never applied: no sample row, no call record, no compute seconds on the run;
its compute seconds logged), while a forward_backward whose client leaves keeps its shield: it completes and is
recorded. The failpoints hold_decode and hold_v1 keep a sample whose request id starts with "hold", and every /v1
sample, decoding (after its first chunk) until it is cancelled."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import func, select

from app.db import Database
from app.tables import CallRecord
from tests.faults.test_deadlines import take_ticket
from tests.helpers.live_server import LiveServer, settings_for

USER_CALLS = 1  # a user's calls in flight: a call behind an untaken ticket holds the user's one place
CREATE = "mutation { createRun(input: {loraR: 2}) { id } }"
SAMPLE = ("mutation($r: ID!) { sample(runId: $r, prompts: [\"hi\"], maxTokens: 200, requestId: \"hold-gone\") "
          "{ sequences { text } } }")
FORWARD_BACKWARD = ("mutation($r: ID!) { forwardBackward(runId: $r, batch: [{text: \"two plus two\"}], "
                    "requestId: \"fb-gone\") { loss } }")
RUN = "query($r: ID!) { run(id: $r) { computeSeconds samples { output } metrics { name } } }"


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SIGNAL_RUNTIME_FAULTS", "hold_decode,hold_v1")
        live = LiveServer.start(settings_for(tmp_path_factory.mktemp("signal-client-gone"), tiny_model_dir,
                                             decode_chunk_seconds=0.001, max_user_calls_in_flight=USER_CALLS))
        yield live
        live.stop()


def runtime_state(server: LiveServer) -> dict[str, Any]:
    return server.backend.client.call("runtime_state", timeout=60)


def records(server: LiveServer, run_id: str) -> int:
    async def count() -> int:
        db = Database(server.settings.resolved_database_url)
        try:
            async with db.session() as session:
                return int(await session.scalar(select(func.count()).where(CallRecord.run_id == run_id)) or 0)
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, count()).result()


def post_and_leave(server: LiveServer, key: str, query: str, variables: dict[str, Any],
                   until: Any, what: str, path: str = "/graphql", payload: dict[str, Any] | None = None) -> None:
    """POST a GraphQL call (or `payload` to `path`) on a raw connection, and close it once `until()` holds, before any
    answer is read."""
    body = json.dumps(payload if payload is not None else {"query": query, "variables": variables}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as client:
        client.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        server.wait_for(until, what)


@pytest.mark.parametrize("front", ["graphql", "v1"])
def test_a_sample_whose_client_leaves_is_withdrawn_unbilled(server: LiveServer, caplog: pytest.LogCaptureFixture,
                                                            front: str) -> None:
    caplog.set_level(logging.INFO, logger="signal.deadlines")
    key = server.new_user()
    run_id = server.graphql(CREATE, key=key)["data"]["createRun"]["id"]
    before = server.graphql(RUN, {"r": run_id}, key=key)["data"]["run"]
    assert records(server, run_id) == 0

    if front == "graphql":
        post_and_leave(server, key, SAMPLE, {"r": run_id}, lambda: bool(runtime_state(server)["decode_groups"]),
                       "the sample to decode")
    else:  # /v1 without a stream: the client waits for the whole answer
        post_and_leave(server, key, "", {}, lambda: bool(runtime_state(server)["decode_groups"]), "the sample to decode",
                       path="/v1/completions", payload={"model": run_id, "prompt": "hi", "max_tokens": 200})
    server.wait_for(lambda: runtime_state(server)["decode_groups"] == [], "the sample to stop decoding", timeout=60)
    marker = "hold-gone" if front == "graphql" else "sample v1-"

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "signal.deadlines" and marker in r.getMessage()
                and "withdrawn (CANCELLED)" in r.getMessage()]

    server.wait_for(lambda: bool(logged()), "the withdrawn sample's log line", timeout=60)
    (line,) = logged()
    assert "never applied, not billed" in line and "compute seconds used" in line
    assert float(line.split("; ")[-1].split()[0]) > 0  # its prefill and first chunk's seconds
    after = server.graphql(RUN, {"r": run_id}, key=key)["data"]["run"]
    assert after["samples"] == [] and after["computeSeconds"] == before["computeSeconds"]
    assert records(server, run_id) == 0  # no call record: nothing billed


def test_a_forward_backward_whose_client_leaves_completes_and_is_recorded(server: LiveServer) -> None:
    key = server.new_user()
    run_id = server.graphql(CREATE, key=key)["data"]["createRun"]["id"]
    take_ticket(server, run_id)  # ticket 1, not sent yet: the call (ticket 2) waits in the runtime behind it
    post_and_leave(server, key, FORWARD_BACKWARD, {"r": run_id},
                   lambda: sum(runtime_state(server)["queue_depth"].values()) == 1, "the call to wait in the runtime")
    assert server.backend.client.submit("run_info", run_id=run_id, ticket=1).result(timeout=60)["run_id"] == run_id
    server.wait_for(lambda: records(server, run_id) == 1, "the forward_backward to be recorded")
    run = server.graphql(RUN, {"r": run_id}, key=key)["data"]["run"]
    assert [metric["name"] for metric in run["metrics"]].count("loss:mean") == 1  # applied once, recorded once
    assert not runtime_state(server)["queue_depth"]


def test_a_runs_next_call_reaches_the_runtime_while_the_one_before_still_decodes(server: LiveServer) -> None:
    # A run's turn ends once its call has left for the runtime, not at its answer (app/services/call_order.py): a
    # forward_backward behind a sample still decoding waits in the runtime's queue, in ticket order, not in the server.
    key = server.new_user()
    run_id = server.graphql(CREATE, key=key)["data"]["createRun"]["id"]
    body = json.dumps({"query": SAMPLE, "variables": {"r": run_id}}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with ThreadPoolExecutor(1) as pool, socket.create_connection((host, int(port)), timeout=60) as client:
        client.sendall(f"POST /graphql HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        server.wait_for(lambda: bool(runtime_state(server)["decode_groups"]), "the sample to decode")
        trained = pool.submit(server.graphql, FORWARD_BACKWARD, {"r": run_id}, key)
        # The decoding sample stays queued on its run until it ends: the forward_backward makes the user's depth 2.
        server.wait_for(lambda: runtime_state(server)["queue_depth"].get(user_of(server, key)) == 2 or trained.done(),
                        "the forward_backward to reach the runtime's queue")
        assert not trained.done()  # queued behind the decoding sample, its run's earlier ticket
        client.close()  # the sample's client leaves: it is withdrawn, and the forward_backward goes
        answered = trained.result(timeout=120)
    assert "errors" not in answered and answered["data"]["forwardBackward"]["loss"] > 0
    assert records(server, run_id) == 1  # the forward_backward alone


def user_of(server: LiveServer, key: str) -> str:
    return str(server.graphql("{ me { id } }", key=key)["data"]["me"]["id"])
