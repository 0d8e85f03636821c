"""Deadlines and cancel (issue 19 §3) on a live server whose optim_step and sample deadlines are 2 s: a call queued in
the runtime past its deadline is withdrawn, answers DEADLINE_EXCEEDED (never applied) and its ticket is counted done,
so the run's next call does not wait the 30 s ticket wait; a sample decoding past its deadline stops, unrecorded; and a
/v1 stream whose client leaves before its first chunk is withdrawn, while one whose client has read text ends at its
deadline with that text (finish_reason "length"), recorded, never with an error event. The failpoints hold_decode and
hold_streams keep a sample whose request id starts with "hold", and every streamed sample, decoding (after its first
chunk) until it is cancelled."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from app.db import Database
from app.tables import Run
from gpu_runtime.engine.tickets import TICKET_WAIT_SECONDS
from rewardsignal import DeadlineExceededError, SignalClient
from tests.helpers.live_server import LiveServer, settings_for

# forward_backward's 20 s is under the runtime's 30 s ticket wait: a call held for a withdrawn ticket would fail.
DEADLINES = {"optim_step": 2.0, "sample": 2.0, "forward_backward": 20.0}
USER_CALLS = 1  # a user's calls in flight: a second one waits in the runtime behind the first
CREATE = "mutation { createRun(input: {loraR: 2}) { id } }"
FORWARD_BACKWARD = "mutation($r: ID!) { forwardBackward(runId: $r, batch: [{text: \"two plus two\"}]) { loss } }"
SAMPLE = ("mutation($r: ID!) { sample(runId: $r, prompts: [\"hi\"], maxTokens: 100, requestId: \"hold-1\") "
          "{ sequences { text } } }")
RUN = "query($r: ID!) { run(id: $r) { step samples { output } metrics { name } } }"


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SIGNAL_RUNTIME_FAULTS", "hold_decode,hold_streams")
        live = LiveServer.start(settings_for(tmp_path_factory.mktemp("signal-deadlines"), tiny_model_dir,
                                             deadlines_s=DEADLINES, decode_chunk_seconds=0.001,
                                             max_user_calls_in_flight=USER_CALLS))
        yield live
        live.stop()


def runtime_state(server: LiveServer) -> dict[str, Any]:
    return server.backend.client.call("runtime_state", timeout=60)


def deadline_exceeded(body: dict[str, Any]) -> dict[str, Any]:
    assert body.get("data") is None, body
    (error,) = body["errors"]
    assert error["extensions"]["code"] == "DEADLINE_EXCEEDED", error
    assert error["extensions"]["retryable"] is False
    return dict(error["extensions"])


def take_ticket(server: LiveServer, run_id: str) -> None:
    """The run's next ticket, taken as another server process would that has not sent its call yet."""
    async def take() -> None:
        db = Database(server.settings.resolved_database_url)
        try:
            async with db.session() as session:
                await session.execute(update(Run).where(Run.id == run_id).values(call_seq=Run.call_seq + 1))
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, take()).result()


def withdrawn(server: LiveServer) -> int:
    return sum(runtime_state(server)["calls_withdrawn"].values())


def test_a_deadline_on_a_queued_call_does_not_delay_the_runs_next_call(server: LiveServer) -> None:
    key = server.new_user()
    run_id = server.graphql(CREATE, key=key)["data"]["createRun"]["id"]
    take_ticket(server, run_id)  # ticket 1, not sent yet
    before = withdrawn(server)

    run = SignalClient(api_key=key, base_url=server.url).get_run(run_id)
    asked = time.monotonic()
    with pytest.raises(DeadlineExceededError) as raised:  # ticket 2 waited in the runtime for ticket 1
        run.optim_step()
    assert raised.value.retryable is False and "optim_step passed its deadline of 2 s" in raised.value.message
    # Answered at its deadline (2 s), not when the ticket wait (30 s) ends: half of it leaves room for a loaded host.
    assert time.monotonic() - asked < TICKET_WAIT_SECONDS / 2
    assert withdrawn(server) == before + 1 and not runtime_state(server)["queue_depth"]  # sent once: no SDK retry
    due = server.backend.client.submit("run_info", run_id=run_id, ticket=1)  # ticket 1 comes after all
    assert due.result(timeout=60)["run_id"] == run_id

    answered = server.graphql(FORWARD_BACKWARD, {"r": run_id}, key=key)  # ticket 3: 2 is not waited for
    assert "errors" not in answered, answered
    row = server.graphql(RUN, {"r": run_id}, key=key)["data"]["run"]
    assert row["step"] == 0  # the optim_step was never applied, nor recorded
    assert "grad_norm" not in {metric["name"] for metric in row["metrics"]}


def test_a_sample_past_its_deadline_stops_decoding_unrecorded(server: LiveServer) -> None:
    key = server.new_user()
    run_id = server.graphql(CREATE, key=key)["data"]["createRun"]["id"]
    with ThreadPoolExecutor(1) as pool:
        sampled = pool.submit(server.graphql, SAMPLE, {"r": run_id}, key)
        server.wait_for(lambda: bool(runtime_state(server)["decode_groups"]) or sampled.done(), "the sample to decode")
        assert not sampled.done()
        deadline_exceeded(sampled.result(timeout=120))
    assert runtime_state(server)["decode_groups"] == []
    assert server.graphql(RUN, {"r": run_id}, key=key)["data"]["run"]["samples"] == []


def test_a_stream_whose_client_leaves_before_its_first_chunk_is_withdrawn(server: LiveServer) -> None:
    key = server.new_user()
    run_id = server.graphql(CREATE, key=key)["data"]["createRun"]["id"]
    take_ticket(server, run_id)  # ticket 1, not sent yet
    before = withdrawn(server)
    with ThreadPoolExecutor(1) as pool:
        # The user's one place in flight (USER_CALLS): a forward_backward waiting in the runtime for ticket 1.
        held = pool.submit(server.graphql, FORWARD_BACKWARD, {"r": run_id}, key)
        server.wait_for(lambda: sum(runtime_state(server)["queue_depth"].values()) == 1, "the held call to queue")
        # A /v1 stream on the run's current weights takes no ticket, but waits behind the user's bound: no chunk comes.
        body = json.dumps({"model": run_id, "prompt": "hi", "max_tokens": 5, "stream": True}).encode()
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as client:
            client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            server.wait_for(lambda: sum(runtime_state(server)["queue_depth"].values()) == 2,
                            "the stream's sample to wait in the runtime")
        # The client is gone: its sample is withdrawn while the held call still waits.
        server.wait_for(lambda: withdrawn(server) == before + 1, "the stream's sample to be withdrawn")
        assert sum(runtime_state(server)["queue_depth"].values()) == 1 and not held.done()
        assert server.backend.client.submit("run_info", run_id=run_id, ticket=1).result(timeout=60)["run_id"] == run_id
        assert "errors" not in held.result(timeout=120)  # ticket 1 came: the held call is answered as usual
    assert withdrawn(server) == before + 1 and not runtime_state(server)["queue_depth"]


def test_a_stream_that_has_sent_text_ends_at_its_deadline_with_that_text(server: LiveServer) -> None:
    key = server.new_user()
    run_id = server.graphql(CREATE, key=key)["data"]["createRun"]["id"]
    body = {"model": run_id, "prompt": "hi", "max_tokens": 100, "stream": True, "temperature": 0}
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert not [event for event in events if "error" in event], events  # no error after the text it was shown
    text = "".join(choice["text"] for event in events for choice in event["choices"])
    assert text and [choice["finish_reason"] for choice in events[-1]["choices"]] == ["length"]
    (stored,) = server.graphql(RUN, {"r": run_id}, key=key)["data"]["run"]["samples"]  # recorded as any answer
    assert stored["output"] == text
    assert runtime_state(server)["decode_groups"] == []


def test_a_deadline_counts_from_when_the_call_could_run(tmp_path: Path, tiny_model_dir: str) -> None:
    """Issue 34 #11: an optim_step pipelined behind a call that holds its run is not failed for that call's time; one
    able to run for its whole deadline, never begun, is withdrawn."""
    from gpu_runtime.engine.engine import Engine
    from tests.helpers.engine_tools import BATCH, submit

    engine = Engine(tmp_path / "data", device="cpu", faults={"hold_decode"}, decode_chunk_seconds=0.001)
    engine.create_run("r", "u", tiny_model_dir, lora={"r": 2})
    engine.forward_backward("r", BATCH)
    held = submit(engine, "sample", run_id="r", prompts=["hi"], max_tokens=50, request_id="hold-1")
    behind = submit(engine, "optim_step", run_id="r", request_id="opt-1")
    engine.tick()  # the sample decodes its first chunk and holds the run
    cancel = {"user_id": "u", "deadline": True, "deadline_s": 3600.0}
    assert engine.call("cancel", request_id="opt-1", **cancel) == {"found": True, "deferred": True}
    engine.call("cancel", request_id="hold-1", user_id="u")  # the sample ends: the optim_step can run
    assert "result" in held.result(timeout=60)
    while not behind.done():
        engine.tick()
    assert behind.result().get("result", {}).get("step") == 1, behind.result()  # applied, though its server's deadline had passed

    late = submit(engine, "optim_step", run_id="r", request_id="opt-2")  # able to run since it came
    assert engine.call("cancel", request_id="opt-2", **{**cancel, "deadline_s": 0.0}) == {"found": True}
    assert late.result(timeout=60)["error"]["code"] == "DEADLINE_EXCEEDED"


def test_a_calls_wait_in_the_server_for_its_predecessor_does_not_count_against_its_deadline(
        server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 34 #11, the server's side: an optim_step (deadline 2 s) numbered 2 waits here for its session's call 1
    longer than its deadline; once call 1 comes, it is applied, not DEADLINE_EXCEEDED."""
    caplog.set_level(logging.INFO, logger="signal.ordering")
    key = server.new_user()
    run_id = server.graphql(CREATE, key=key)["data"]["createRun"]["id"]
    numbered = "mutation($r: ID!, $s: Int!) { %s(runId: $r, seq: $s, session: \"pipe\"%s) { %s } }"
    optim = numbered % ("optimStep", "", "step")
    forward_backward = numbered % ("forwardBackward", ", batch: [{text: \"two plus two\"}]", "loss")
    with ThreadPoolExecutor(1) as pool:
        behind = pool.submit(server.graphql, optim, {"r": run_id, "s": 2}, key)
        server.wait_for(lambda: any("call 2 of session pipe waits for call 1" in r.getMessage()
                                    for r in caplog.records), "call 2 to wait for call 1")
        # Another run's optim_step passing its 2 s deadline: that long has gone by for call 2 too.
        other = server.graphql(CREATE, key=key)["data"]["createRun"]["id"]
        take_ticket(server, other)
        with pytest.raises(DeadlineExceededError):
            SignalClient(api_key=key, base_url=server.url).get_run(other).optim_step()
        server.backend.client.submit("run_info", run_id=other, ticket=1).result(timeout=60)
        assert not behind.done()  # still waiting for call 1, past its deadline
        first = server.graphql(forward_backward, {"r": run_id, "s": 1}, key=key)
        assert "errors" not in first, first
        answered = behind.result(timeout=120)
    assert "errors" not in answered, answered
    assert answered["data"]["optimStep"]["step"] == 1
