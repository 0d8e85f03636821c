"""Idempotency end to end: a primitive sent twice with one requestId is applied and recorded once, and the SDK
sends a call whose connection dropped again, with the same id."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer, error_code
from tests.helpers.transports import DropFirstAnswer

BATCH = [{"text": "one example the run learns from"}]

MUTATIONS: dict[str, str] = {
    "forwardBackward": """mutation($id: ID!, $batch: [BatchItem!]!, $rid: String) {
        forwardBackward(runId: $id, batch: $batch, requestId: $rid) { loss numTokens step } }""",
    "optimStep": """mutation($id: ID!, $rid: String) {
        optimStep(runId: $id, adam: {learningRate: 0.01}, requestId: $rid) { step gradNorm } }""",
    "sample": """mutation($id: ID!, $rid: String) {
        sample(runId: $id, prompts: ["hello"], maxTokens: 4, seed: 1, requestId: $rid) { outputs } }""",
    "saveState": """mutation($id: ID!, $rid: String) {
        saveState(runId: $id, requestId: $rid) { id step checkpointPath } }""",
}

# What each mutation records, read back through the API: it must not change when the call is retried.
RECORDED: dict[str, Callable[[Any], Any]] = {
    "forwardBackward": lambda run: (run.refresh().step, len(run.metrics(name="loss:mean"))),
    "optimStep": lambda run: (run.refresh().step, len(run.metrics(name="grad_norm"))),
    "sample": lambda run: len(run.samples()),
    "saveState": lambda run: len(run.checkpoints()),
}
EXPECTED = {"forwardBackward": (0, 2), "optimStep": (1, 1), "sample": 1, "saveState": 1}


def ready_run(client: SignalClient):  # type: ignore[no-untyped-def]
    run = client.create_run(lora_r=4)
    run.forward_backward(batch=BATCH)  # optimStep needs gradients; the others do not mind them
    return run


@pytest.mark.parametrize("mutation", [
    "forwardBackward", "optimStep", "sample", "saveState"])
def test_a_request_id_sent_twice_is_applied_once(live_server: LiveServer, key: str, mutation: str) -> None:
    run = ready_run(SignalClient(api_key=key, base_url=live_server.url))
    variables = {"id": run.id, "batch": BATCH, "rid": str(uuid.uuid4())}
    first = live_server.graphql(MUTATIONS[mutation], variables, key=key)
    assert "errors" not in first
    again = live_server.graphql(MUTATIONS[mutation], variables, key=key)
    assert "errors" not in again
    assert again["data"] == first["data"]  # the first attempt's answer
    assert RECORDED[mutation](run) == EXPECTED[mutation]


def test_request_ids_are_bounded(live_server: LiveServer, key: str) -> None:
    run = ready_run(SignalClient(api_key=key, base_url=live_server.url))
    body = live_server.graphql(MUTATIONS["forwardBackward"], {"id": run.id, "batch": BATCH, "rid": "x" * 129},
                               key=key)
    assert error_code(body) == "BAD_INPUT" and body["errors"][0]["extensions"]["field"] == "requestId"


@pytest.mark.parametrize(("operation", "call"), [
    ("ForwardBackward", lambda run: run.forward_backward(batch=BATCH)),
    ("Sample", lambda run: run.sample(prompts=["hello"], max_tokens=4, seed=1)),
])
def test_sdk_sends_a_dropped_call_again_with_the_same_request_id(live_server: LiveServer, key: str, operation: str,
                                                                  call: Callable[[Any], Any]) -> None:
    run_id = ready_run(SignalClient(api_key=key, base_url=live_server.url)).id
    transport = DropFirstAnswer(operation)
    client = SignalClient(api_key=key, base_url=live_server.url, transport=transport, retry_backoff=0.01)
    run = client.get_run(run_id)
    assert call(run) is not None
    first, retry = transport.sent
    assert first == retry and uuid.UUID(first["requestId"])
    call(run)
    assert transport.sent[2]["requestId"] != first["requestId"]  # a new call, a new id


def test_sdk_retry_of_a_dropped_optim_step_is_applied_once(live_server: LiveServer, key: str) -> None:
    run_id = ready_run(SignalClient(api_key=key, base_url=live_server.url)).id
    transport = DropFirstAnswer("OptimStep")
    client = SignalClient(api_key=key, base_url=live_server.url, transport=transport, retry_backoff=0.01)
    run = client.get_run(run_id)
    assert run.optim_step(learning_rate=0.01).step == 1
    assert len(transport.sent) == 2
    assert run.refresh().step == 1 and len(run.metrics(name="grad_norm")) == 1


def test_a_named_save_and_a_load_sent_twice_are_applied_once(live_server: LiveServer, key: str) -> None:
    run = ready_run(SignalClient(api_key=key, base_url=live_server.url))
    run.optim_step()
    save = """mutation($id: ID!, $rid: String) {
        saveState(runId: $id, mode: STATE, name: "one", requestId: $rid) { id name step path } }"""
    saved = [live_server.graphql(save, {"id": run.id, "rid": "save-1"}, key=key) for _ in range(2)]
    assert "errors" not in saved[0] and saved[1] == saved[0]  # a retry, not a second save of the name
    load = """mutation($id: ID!, $path: String!, $rid: String) {
        loadState(runId: $id, checkpoint: $path, requestId: $rid) { step } }"""
    variables = {"id": run.id, "path": saved[0]["data"]["saveState"]["path"], "rid": str(uuid.uuid4())}
    run.forward_backward(batch=BATCH)
    run.optim_step()
    assert live_server.graphql(load, variables, key=key)["data"]["loadState"]["step"] == 1
    run.forward_backward(batch=BATCH)
    run.optim_step()
    assert live_server.graphql(load, variables, key=key)["data"]["loadState"]["step"] == 1  # the first answer
    assert run.refresh().step == 2  # and nothing loaded again


@pytest.mark.parametrize("mutation", ["forwardBackward", "sample"])
def test_a_request_id_reused_with_another_body_is_refused_naming_it(live_server: LiveServer, key: str,
                                                                    mutation: str) -> None:
    """Issue 19 §5: the runtime keeps each answer's body hash; another call under a used id is not that call's retry."""
    run = ready_run(SignalClient(api_key=key, base_url=live_server.url))
    variables = {"id": run.id, "batch": BATCH, "rid": str(uuid.uuid4())}
    first = live_server.graphql(MUTATIONS[mutation], variables, key=key)
    assert "errors" not in first
    changed = {"forwardBackward": (MUTATIONS[mutation], {**variables, "batch": [{"text": "a different example"}]}),
               "sample": (MUTATIONS[mutation].replace('"hello"', '"goodbye"'), variables)}
    document, other = changed[mutation]
    refused = live_server.graphql(document, other, key=key)
    assert error_code(refused) == "BAD_INPUT", refused
    assert refused["errors"][0]["extensions"]["field"] == "requestId"
    assert live_server.graphql(MUTATIONS[mutation], variables, key=key)["data"] == first["data"]  # still a retry
    assert RECORDED[mutation](run) == EXPECTED[mutation]  # the refused call recorded nothing
