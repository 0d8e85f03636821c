"""A call in flight through two runtime deaths in a row is not sent again (issue 19 §1): the first death answers
WORKER_FAILED retryable, the retry's (the same request id) WORKER_FAILED with `retryable: false`, and a third try is
answered so without reaching the runtime, whichever server process each try reaches (two servers on one data
directory share its runtime, and the count). The failpoint die_in_prepare kills the runtime while preparing any call
whose request id starts with "poison"; other users' calls, and the same user's other calls, are answered."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.live_server import LiveServer, settings_for

CREATE = "mutation { createRun(input: {loraR: 2}) { id } }"
FORWARD_BACKWARD = ("mutation($r: ID!, $id: String) { forwardBackward(runId: $r, batch: [{text: \"two plus two\"}], "
                    "requestId: $id) { loss } }")


@pytest.fixture(scope="module")
def servers(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, LiveServer]]:
    """Two server processes' worth (as `uvicorn --workers 2` makes) on one data directory: one runtime between them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SIGNAL_RUNTIME_FAULTS", "die_in_prepare")  # every runtime the server starts has it
        data_dir = tmp_path_factory.mktemp("signal-poison")
        first = LiveServer.start(settings_for(data_dir, tiny_model_dir))
        second = LiveServer.start(settings_for(data_dir, tiny_model_dir))
        yield first, second
        second.stop()
        first.stop()


def worker_failed(body: dict[str, Any]) -> dict[str, Any]:
    assert body.get("data") is None, body
    (error,) = body["errors"]
    assert error["extensions"]["code"] == "WORKER_FAILED", error
    return dict(error["extensions"])


def fb(server: LiveServer, key: str, run_id: str, request_id: str) -> dict[str, Any]:
    return server.graphql(FORWARD_BACKWARD, {"r": run_id, "id": request_id}, key=key)


def test_a_call_that_kills_the_runtime_twice_is_not_sent_a_third_time(servers: tuple[LiveServer, LiveServer]) -> None:
    server, another = servers
    key, other = server.new_user(), server.new_user()
    run_id = server.graphql(CREATE, key=key)["data"]["createRun"]["id"]
    others_run = server.graphql(CREATE, key=other)["data"]["createRun"]["id"]

    assert worker_failed(fb(server, key, run_id, "poison-1"))["retryable"] is True  # the first death: maybe not ours
    # The SDK's retry, accepted by the other server process: the second death in a row.
    assert worker_failed(fb(another, key, run_id, "poison-1"))["retryable"] is False
    answered = fb(server, other, others_run, "other-1")  # another user's call, answered by a third runtime
    assert "errors" not in answered, answered
    pid = server.backend.client.pid

    third = worker_failed(fb(server, key, run_id, "poison-1"))  # refused by the server: the runtime never sees it
    assert third["retryable"] is False
    assert server.backend.client.pid == pid
    assert server.backend.client.alive
    fine = fb(server, key, run_id, "fine-1")  # the same user's other calls go on
    assert "errors" not in fine, fine
    # One forwardBackward's metric rows on each run: the poison pill was never applied.
    assert metric_names(server, key, run_id) == metric_names(server, other, others_run) != []


def metric_names(server: LiveServer, key: str, run_id: str) -> list[str]:
    body = server.graphql("query($r: ID!) { run(id: $r) { metrics { name } } }", {"r": run_id}, key=key)
    return sorted(metric["name"] for metric in body["data"]["run"]["metrics"])
