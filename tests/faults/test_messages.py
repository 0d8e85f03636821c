"""Errors name their field in the API's spelling and quote at most a short prefix of the input."""

from __future__ import annotations

import httpx
import pytest

from gpu_runtime.errors import MAX_MESSAGE_CHARS
from tests.helpers.live_server import LiveServer

CREATE = "mutation($m: String) { createRun(input: {baseModel: $m, loraR: 2}) { id } }"


def create_run(server: LiveServer, key: str, base_model: str) -> dict[str, object]:
    response = httpx.post(f"{server.url}/graphql", json={"query": CREATE, "variables": {"m": base_model}},
                          headers={"Authorization": f"Bearer {key}"}, timeout=60)
    (error,) = response.json()["errors"]
    return dict(error)


@pytest.mark.parametrize("base_model", ["", "   "], ids=["empty", "blank"])
def test_an_empty_base_model_is_refused_not_the_default(live_server: LiveServer, key: str, base_model: str) -> None:
    error = create_run(live_server, key, base_model)
    assert error["extensions"] == {"code": "BAD_INPUT", "field": "baseModel", "retryable": False}


def test_a_huge_input_is_quoted_by_a_prefix(live_server: LiveServer, key: str) -> None:
    error = create_run(live_server, key, "m" * 1_000_000)
    assert error["extensions"] == {"code": "BAD_INPUT", "field": "baseModel", "retryable": False}
    message = str(error["message"])
    assert len(message) < MAX_MESSAGE_CHARS + 60
    assert message.startswith("unknown base model 'mmm") and message.endswith("(add yours to config/models.yaml)")


SAMPLE = "mutation($r: ID!, $p: [String!]) { sample(runId: $r, prompts: $p) { outputs } }"
FORWARD_BACKWARD = "mutation($r: ID!, $b: [BatchItem!]!) { forwardBackward(runId: $r, batch: $b) { loss } }"
OPTIM_STEP = ("mutation($r: ID!, $a: AdamInput) { ...step } "
              "fragment step on Mutation { optimStep(runId: $r, adam: $a) { step } }")
CREATE_WITH = "mutation($i: CreateRunInput) { createRun(input: $i) { id } }"


@pytest.mark.parametrize(("query", "variables", "field"), [
    (SAMPLE, {"r": "x", "p": ["a", 3]}, "prompts[1]"),  # the argument's name, not the client's `$p`
    (FORWARD_BACKWARD, {"r": "x", "b": [{"text": "a"}, {"nope": 1}]}, "batch[1]"),
    (FORWARD_BACKWARD, {"r": "x"}, "batch"),  # a required variable left out
    (FORWARD_BACKWARD, {"r": "x", "b": [{"tokens": [1, "two"]}]}, "batch[0].tokens[1]"),
    (OPTIM_STEP, {"r": "x", "a": {"learningRate": "fast"}}, "adam.learningRate"),  # used inside a fragment
    (CREATE_WITH, {"i": {"loraR": "two"}}, "input.loraR"),
    (CREATE, {"m": 5}, "input.baseModel"),  # a variable inside an object literal
], ids=["list-item", "unknown-key", "missing", "nested", "fragment", "input-field", "in-literal"])
def test_a_variable_that_does_not_coerce_names_its_field(live_server: LiveServer, key: str, query: str,
                                                         variables: dict[str, object], field: str) -> None:
    response = httpx.post(f"{live_server.url}/graphql", json={"query": query, "variables": variables},
                          headers={"Authorization": f"Bearer {key}"}, timeout=60)
    body = response.json()
    assert body.get("data") is None, body
    (error,) = body["errors"]
    assert error["extensions"] == {"code": "BAD_INPUT", "field": field, "retryable": False}
    assert error["message"].startswith("Variable '$")
